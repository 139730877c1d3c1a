// Shared by the dashboard pages.
// Big columns arrive compact (typed arrays in base64; keys, labels and colours once) and
// are expanded into the figures' sources once those exist.
"use strict";

function typed(b64, T) {
  if (Uint8Array.fromBase64) return new T(Uint8Array.fromBase64(b64).buffer);  // native decoder
  const bin = atob(b64), bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  return new T(bytes.buffer);
}

function expandStream(p) {
  const c = typed(p.c, Int32Array), k = typed(p.k, Int32Array), n = typed(p.n, Int32Array);
  const colour = new Array(p.count), alpha = new Float64Array(p.count), key = new Array(p.count), name = new Array(p.count);
  for (let i = 0; i < p.count; i++) {
    const ca = p.colours[c[i]]; colour[i] = ca[0]; alpha[i] = ca[1];
    key[i] = p.keys ? p.keys[k[i]] : ""; name[i] = p.names[n[i]];
  }
  return {x: typed(p.x, Float64Array), width: typed(p.width, Float64Array), y: typed(p.y, Int32Array),
          colour, alpha, key, name, k};
}

// The run page leaves the task keys (the hover's; half of a big run's page) out of the
// page: ``keys_url`` names them, in the order the payload's ``k`` indexes. fetchKeys starts
// their requests (the server and the transfer overlap BokehJS building the figures);
// fillKeys reads them once the stream is painted and sets body[data-keys].
function fetchKeys(sources) {
  const out = {};
  for (const [name, payload] of Object.entries(sources)) {
    if (payload.keys_url) out[name] = fetch(payload.keys_url, {credentials: "same-origin"});
  }
  return out;
}

function fillKeys(sources, requests) {
  const loads = [];
  for (const [name, payload] of Object.entries(sources)) {
    const s = streams[name], request = requests[name];
    if (request === undefined || s === undefined) continue;
    loads.push(request.then(r => {
      if (!r.ok) throw new Error(`task keys: HTTP ${r.status}`);
      return r.json();
    }).then(keys => {
      if (keys.length !== payload.tasks) {  // the run changed since the page was read
        console.warn(`task keys: ${keys.length} for ${payload.tasks} tasks; hover without keys`);
        return;
      }
      const k = s.data.k, key = s.model.data.key;
      for (let i = 0; i < k.length; i++) key[i] = keys[k[i]];
      // In place, without a change event: the hover reads the column when it shows, and a
      // new data object made BokehJS redo every column of 130k rectangles.
      s.data.key = key;
    }));
  }
  return Promise.all(loads).then(() => { performance.mark("hs-keys"); document.body.dataset.keys = "1"; });
}

// A task stream is painted as an image at the screen's resolution, redrawn when the view
// moves; the per-task rectangles (the source the page fills: hover, tests) are drawn by
// nothing (their loop costs ~0.03 s a frame). Filled one by one on the canvas, the 129,891
// rectangles of the dashboard bench's run took ~0.6 s of every frame (the first view and
// each step of a pan) in headless Chromium here; drawing the image takes ~0.07 s, and
// grows with the screen, not the run. Each rectangle is blended into its row (source-over,
// its alpha times how much of each pixel it covers), as the canvas would blend it.
const STREAM_HEIGHT = 0.85;
const streams = {};
const rgbOf = new Map();

function rgb(colour) {
  let v = rgbOf.get(colour);
  if (v === undefined) {
    const ctx = document.createElement("canvas").getContext("2d");
    ctx.fillStyle = "#000"; ctx.fillStyle = colour;  // the browser parses any CSS colour
    const hex = ctx.fillStyle;  // "#rrggbb" (or rgba(...) for a translucent one)
    const m = /^#([0-9a-f]{6})$/i.exec(hex), n = m ? parseInt(m[1], 16) : 0x808080;
    v = [(n >> 16) & 255, (n >> 8) & 255, n & 255];
    rgbOf.set(colour, v);
  }
  return v;
}

function frameOf(plot) {
  const view = Bokeh.index.query_one(v => v.model === plot);
  return view && view.frame ? view.frame.bbox : null;
}

function rasterise(s, force) {
  const d = s.data, n = d.x.length, bbox = frameOf(s.plot), xr = s.plot.x_range;
  // Setting the image may touch the range: redraw only when the view did change.
  const view = [xr.start, xr.end, bbox && bbox.width, bbox && bbox.height].join();
  if (!force && view === s.view) return;
  s.view = view;
  if (!bbox || !n) { s.paint.data = {image: [], x: [], y: [], dw: [], dh: []}; return; }
  let min = Infinity, max = -Infinity;
  for (let i = 0; i < n; i++) {
    min = Math.min(min, d.x[i] - d.width[i] / 2); max = Math.max(max, d.x[i] + d.width[i] / 2);
  }
  // The view, but never past the data: the image must not widen an auto-ranged axis.
  const rows = s.rows;
  const lo = Math.max(min, xr.start < xr.end ? xr.start : min);
  const hi = Math.min(max, xr.start < xr.end ? xr.end : max);
  if (!(hi > lo)) { s.paint.data = {image: [], x: [], y: [], dw: [], dh: []}; return; }  // panned off the data
  const ratio = window.devicePixelRatio || 1;
  const W = Math.max(1, Math.round(bbox.width * ratio * (hi - lo) / ((xr.end - xr.start) || (hi - lo))));
  const H = Math.max(1, Math.round(bbox.height * ratio));
  const scale = W / ((hi - lo) || 1), rowPx = H / rows;
  // premultiplied RGBA per pixel of each row's line
  const line = new Float32Array(rows * W * 4);
  for (let i = 0; i < n; i++) {
    const alpha = d.alpha[i];
    if (!(alpha > 0)) continue;
    const a = (d.x[i] - d.width[i] / 2 - lo) * scale, b = (d.x[i] + d.width[i] / 2 - lo) * scale;
    if (b < 0 || a > W) continue;
    const [r, g, bl] = rgb(d.colour[i]), row = d.y[i] * W * 4;
    const first = Math.max(0, Math.floor(a)), last = Math.min(W - 1, Math.ceil(b) - 1);
    for (let p = first; p <= last; p++) {
      const cover = Math.min(b, p + 1) - Math.max(a, p);
      const k = alpha * (cover > 1 ? 1 : cover), o = row + p * 4, keep = 1 - k;
      line[o] = line[o] * keep + r * k; line[o + 1] = line[o + 1] * keep + g * k;
      line[o + 2] = line[o + 2] * keep + bl * k; line[o + 3] = line[o + 3] * keep + k;
    }
  }
  // each row's line down its band of pixel rows (image row 0 is data y = -0.5)
  const img = new Uint32Array(W * H), px = new Uint32Array(W);
  for (let y = 0; y < rows; y++) {
    for (let p = 0, o = y * W * 4; p < W; p++, o += 4) {
      const A = line[o + 3];
      px[p] = A > 0 ? ((Math.round(A * 255) << 24) | (Math.round(line[o + 2] / A) << 16)
                       | (Math.round(line[o + 1] / A) << 8) | Math.round(line[o] / A)) >>> 0 : 0;
    }
    const top = Math.round((y + 0.5 - STREAM_HEIGHT / 2) * rowPx);
    const bottom = Math.max(top + 1, Math.round((y + 0.5 + STREAM_HEIGHT / 2) * rowPx));
    for (let row = top; row < Math.min(bottom, H); row++) img.set(px, row * W);
  }
  const {ndarray} = Bokeh.require("core/util/ndarray");
  s.paint.data = {image: [ndarray(img, {shape: [H, W]})], x: [lo], y: [-0.5], dw: [hi - lo], dh: [rows]};
}

function modelNamed(name) {
  for (const doc of Bokeh.documents) {
    const model = doc.get_model_by_name(name);
    if (model) return [doc, model];
  }
  return [null, null];
}

// A stream source's new columns, and its painted image (the source named painted-NAME).
function setStream(name, data) {
  let s = streams[name];
  if (s === undefined) {
    const [doc, model] = modelNamed(name), [, paint] = modelNamed("painted-" + name);
    if (!model) return;
    s = {model, paint, plot: null, rows: 1, data, pending: null};
    for (const m of doc.all_models) {
      if (m.renderers && m.x_range && m.renderers.some(r => r.data_source === model)) s.plot = m;
    }
    if (paint && s.plot) {
      s.rows = s.plot.y_range.start + 0.5;  // Range1d(rows - 0.5, -0.5)
      const later = () => { clearTimeout(s.pending); s.pending = setTimeout(() => rasterise(s), 50); };
      s.plot.x_range.change.connect(later);
      window.addEventListener("resize", later);
    }
    streams[name] = s;
  }
  s.data = data;
  // In place, then announced: a new data object (setv) made BokehJS walk every value of
  // every column for models it might hold (~0.3 s of a first view's 82,000 bins).
  const columns = s.model.data;
  for (const k of Object.keys(columns)) if (!(k in data)) delete columns[k];
  Object.assign(columns, data);
  s.model.change.emit();
  if (s.paint && s.plot) rasterise(s, true);
}

// A stream filled whole, or (a payload with a url: a big run's) fetched in windows; returns
// a promise of every stream's first data. ``first``: requests already started for the
// first windows (``firstWindows``), by source name.
function fill(sources, first) {
  const loads = [];
  for (const [name, payload] of Object.entries(sources)) {
    if (payload.url) loads.push(streamWindows(name, payload, (first || {})[name]));
    else setStream(name, expandStream(payload));
  }
  return Promise.all(loads);
}

function windowUrl(p, a, b, width) {
  return `${p.url}?start=${p.origin + a}&stop=${p.origin + b}&width=${width}&max_rects=${p.max_rects}`;
}

// The whole-run windows of the streams fetched in windows, asked for before the figures are
// built (the server's answer overlaps BokehJS's work), at about the width the plot will have
// (the page's less its margins, before ``element`` is laid out).
function firstWindows(sources, element) {
  const out = {}, el = document.getElementById(element);
  const room = el ? el.clientWidth : document.documentElement.clientWidth - 34;
  const width = Math.max(100, Math.min(4000, Math.round(room - 110)));
  for (const [name, p] of Object.entries(sources)) {
    if (!p.url) continue;
    const url = windowUrl(p, 0, p.span, width);
    out[name] = {url, answer: fetch(url, {credentials: "same-origin"})};
  }
  return out;
}

// A big run's task stream, fetched from the task-stream route for the window in view at
// the plot's width in pixels, again (150 ms after the view stops moving) when it moves:
// bins of busy seconds painted in their dominant prefix's colour (alpha: how busy) at
// overview, the start/stops themselves with their keys once a window holds few enough.
// body[data-stream-mode] tells which the stream shows.
function streamWindows(name, p, first) {
  const empty = {x: [], width: [], y: [], colour: [], alpha: [], key: [], name: []};
  setStream(name, empty);
  performance.mark("hs-window-empty");
  const s = streams[name];
  if (!s || !s.plot) return Promise.resolve();
  let asked = null, ticket = 0, timer = null;
  const style = n => p.styles[n] || ["gray", 0.4];
  const fromRects = w => {
    const r = w.rects, n = r.start.length;
    const d = {x: new Float64Array(n), width: new Float64Array(n), y: new Int32Array(n),
               colour: new Array(n), alpha: new Float64Array(n), key: r.key, name: new Array(n)};
    for (let i = 0; i < n; i++) {
      d.x[i] = (r.start[i] + r.stop[i]) / 2 - p.origin; d.width[i] = r.stop[i] - r.start[i];
      d.y[i] = r.lane[i];
      const compute = r.action[i] === "compute", [c, a] = style(compute ? r.prefix[i] : r.action[i]);
      d.colour[i] = r.erred[i] ? p.erred : c; d.alpha[i] = a;
      d.name[i] = compute ? r.prefix[i] : r.action[i] + " " + r.prefix[i];
    }
    return d;
  };
  const fromBins = w => {
    const b = w.bins, e = b.edges, d = {x: [], width: [], y: [], colour: [], alpha: [], key: [], name: []};
    b.busy.forEach((row, lane) => row.forEach((busy, i) => {
      const top = b.prefix[lane][i];
      if (!(busy > 0) || top < 0) return;
      const span = e[i + 1] - e[i], [c, a] = style(w.names[top]);
      d.x.push((e[i] + e[i + 1]) / 2 - p.origin); d.width.push(span); d.y.push(lane);
      d.colour.push(c); d.alpha.push(a * Math.min(1, busy / span));
      d.key.push(`${b.count[lane][i]} start/stops, ${Math.round(100 * busy / span)}% busy`);
      d.name.push(`${w.names[top]} (${b.prefix_count[lane][i]} of them)`);
    }));
    return d;
  };
  const load = started => {
    const xr = s.plot.x_range, bbox = frameOf(s.plot);
    let a = Math.max(0, xr.start), b = Math.min(p.span, xr.end);
    if (!(b > a)) { a = 0; b = p.span; }
    const width = Math.max(1, Math.min(4000, Math.round(bbox ? bbox.width : 1000)));
    const url = started ? started.url : windowUrl(p, a, b, width);
    if (url === asked) return Promise.resolve();
    asked = url;
    const mine = ++ticket;
    const answer = started ? started.answer : fetch(url, {credentials: "same-origin"});
    return answer.then(r => {
      if (!r.ok) throw new Error(`task stream: HTTP ${r.status}`);
      return r.json();
    }).then(w => {
      if (mine !== ticket) return;  // a later window was asked for meanwhile
      performance.mark("hs-window-fetched");
      const data = w.mode === "rects" ? fromRects(w) : fromBins(w);
      performance.mark("hs-window-built");
      setStream(name, data);
      performance.mark("hs-window-set");
      // replay.js cuts the stream at its slider's time: it cuts the new window too
      document.dispatchEvent(new CustomEvent("hs-stream-window", {detail: name}));
      document.body.dataset.streamMode = w.mode;
    });
  };
  s.plot.x_range.change.connect(() => { clearTimeout(timer); timer = setTimeout(load, 150); });
  return load(first);
}

// Two time ranges of one page kept together, each following the other's start and end:
// a run page's task stream and the plots under it are separate Bokeh documents (embedded
// one after the other), which cannot share one range.
function linkRanges(a, b) {
  const [, ra] = modelNamed(a), [, rb] = modelNamed(b);
  if (!ra || !rb) return;
  rb.setv({start: ra.start, end: ra.end});
  const follow = (from, to) => from.change.connect(() => {
    if (to.start !== from.start || to.end !== from.end) to.setv({start: from.start, end: from.end});
  });
  follow(ra, rb);
  follow(rb, ra);
}

// The frames of plots on one time axis, one above the other, starting at one x: the left
// border of each as wide as the widest's (a run page's task stream, with its lanes' long
// names, and the plots under it are separate Bokeh documents, which no one column aligns).
// Returns the roots to lay out again (``fitLegends``'s ``also``).
function alignFrames(ranges) {
  const plots = [];
  for (const doc of Bokeh.documents) {
    for (const m of doc.all_models) {
      if (m.x_range && m.renderers && ranges.includes(m.x_range.name)) {
        const view = Bokeh.index.find_one(m);
        if (view && view.frame) plots.push([m, view]);
      }
    }
  }
  const left = Math.max(0, ...plots.map(([, v]) => v.frame.bbox.left));
  const roots = new Set();
  for (const [m, v] of plots) {
    if (v.frame.bbox.left < left) { m.setv({min_border_left: left}, {silent: true}); roots.add(v.root); }
  }
  return roots;
}

// A script loaded once, when a page first needs it.
const scripts = {};
function loadScript(src) {
  if (!scripts[src]) scripts[src] = new Promise((ok, fail) => {
    const el = document.createElement("script");
    el.src = src; el.onload = ok; el.onerror = () => fail(new Error(`could not load ${src}`));
    document.head.append(el);
  });
  return scripts[src];
}

const painted = () => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));

// Legends above their plot (services/dashboard/legends.py tags them {fit: the plot's height
// without its legend}) in as many columns as the plot's width holds: Bokeh lays a legend
// out in a fixed number of columns, which the server chose for a wide screen. The plot
// grows by the rows its legend takes; its frame keeps its height. Returns a promise of the
// page painted with them (at once when nothing changed).
const legendFont = document.createElement("canvas").getContext("2d");
const fullLabels = new WeakMap();

// ``paint``: resolve once the new layout is painted; a page that draws more right after
// (the run and compare pages' task streams) passes false and paints once, not twice.
function fitLegends(paint = true, also = new Set()) {
  let changed = also.size > 0;
  const roots = new Set(also);  // of the plots whose legend changed, and ``also``
  for (const doc of Bokeh.documents) {
    const models = [...doc.all_models];
    for (const legend of models) {
      if (legend.type !== "Legend") continue;
      const fit = legend.tags.find(t => t && typeof t === "object" && "fit" in t);
      const plot = fit && models.find(m => Array.isArray(m.above) && m.above.includes(legend));
      const view = plot && Bokeh.index.find_one(plot);
      if (!view || !view.frame) continue;
      legendFont.font = `${legend.label_text_font_size} ${legend.label_text_font}`;
      // a left border widened (``alignFrames``) and not laid out yet narrows the frame
      const wider = Math.max(0, (plot.min_border_left || 0) - view.frame.bbox.left);
      const room = view.frame.bbox.width - wider - 2 * (legend.padding + legend.margin);
      const swatch = legend.glyph_width + legend.label_standoff + 2 * legend.spacing + 4;
      // a label wider than the plot (a phone's) is cut to fit, whole again on a wider one
      const labels = legend.items.map(item => {
        if (!fullLabels.has(item)) fullLabels.set(item, typeof item.label === "string" ? item.label : (item.label && item.label.value) || "");
        const full = fullLabels.get(item);
        let label = full;
        while (label.length > 1 && swatch + legendFont.measureText(label).width > room)
          label = full.slice(0, label.length - 2) + "…";
        const shown = typeof item.label === "string" ? item.label : item.label && item.label.value;
        if (shown !== label) { item.setv({label: {value: label}}, {silent: true}); changed = true; roots.add(view.root); }
        return label;
      });
      const widths = labels.map(l => swatch + Math.max(legend.label_width, legendFont.measureText(l).width));
      // entries go row by row; each column as wide as its widest entry
      let ncols = Math.max(1, labels.length);
      for (; ncols > 1; ncols--) {
        const cols = new Array(ncols).fill(0);
        widths.forEach((w, i) => { cols[i % ncols] = Math.max(cols[i % ncols], w); });
        if (cols.reduce((a, b) => a + b, 0) <= room) break;
      }
      const rows = labels.length ? Math.ceil(labels.length / ncols) : 0;
      const height = fit.fit + (rows ? rows * (legend.label_height + legend.spacing)
                                       + 2 * (legend.padding + legend.margin) : 0)
                     + (legend.title ? legend.label_height + legend.spacing : 0);
      if (legend.ncols !== ncols) { legend.setv({ncols}, {silent: true}); changed = true; roots.add(view.root); }
      if (plot.height !== height) { plot.setv({height}, {silent: true}); changed = true; roots.add(view.root); }
    }
  }
  performance.mark("hs-legends-fitted");
  if (!changed) return Promise.resolve();
  // Set silently, then laid out once: each change announced on its own laid the whole page
  // out again (a run page's dozen of them took ~1 s). Only the figures holding a changed
  // legend: the first view's are laid out again by nothing embedded after it.
  for (const root of Bokeh.index.roots) {
    if (!roots.has(root)) continue;
    for (const v of root.all_views ? root.all_views() : [root]) if (v.invalidate_render) v.invalidate_render();
    if (root.invalidate_layout) root.invalidate_layout();
  }
  performance.mark("hs-legends-laid-out");
  return paint ? painted() : Promise.resolve();
}

let legendsPending = null;
window.addEventListener("resize", () => {
  clearTimeout(legendsPending);
  legendsPending = setTimeout(() => window.Bokeh && fitLegends(), 100);
});
