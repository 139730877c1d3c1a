// Replay on the run page: a time slider that shows the run at time t as Dask's status page
// showed it live (GET /v1/runs/{id}/state?at=t), and the task stream up to t.
// Bytes per worker: managed blue (orange from the spill target up, red past terminate),
// unmanaged the same colour lighter, spilled grey. Progress by prefix: released in the
// prefix colour transparent, in memory solid, erred black, processing hatched, waiting grey.
"use strict";

function replaySetup(opts) {
  const slider = document.getElementById("replay-slider");
  const label = document.getElementById("replay-time");
  if (!slider) return;
  let asked = 0, shown = 0, timer = null, stream = null;

  const fmtBytes = b => {
    const u = ["B", "kB", "MB", "GB", "TB"];
    let i = 0;
    while (b >= 1000 && i < u.length - 1) { b /= 1000; i++; }
    return (i ? b.toFixed(1) : b.toFixed(0)) + " " + u[i];
  };
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const seg = (cls, share, colour, title) => {
    const s = el("span", "seg " + cls);
    s.style.width = (100 * share).toFixed(3) + "%";
    if (colour) s.style.background = colour;
    s.title = title;
    return s;
  };
  const row = (name, bar, text, attrs) => {
    const r = el("div", "replay-row");
    for (const [k, v] of Object.entries(attrs || {})) r.dataset[k] = v;
    r.append(el("span", "replay-name", name), bar, el("span", "replay-value", text));
    return r;
  };

  function memoryColour(w, th) {
    const used = w.memory.managed + w.memory.unmanaged, limit = w.memory.limit;
    if (!limit) return "#1f77b4";
    if (th.terminate && used >= limit * th.terminate) return "#d62728";
    const orange = Math.min(th.target || 1, th.spill || 1);
    return used >= limit * orange ? "#ff7f0e" : "#1f77b4";
  }

  function draw(state) {
    const th = state.thresholds || {};
    const mem = document.getElementById("replay-memory");
    const proc = document.getElementById("replay-processing");
    const prog = document.getElementById("replay-progress");
    mem.replaceChildren(); proc.replaceChildren(); prog.replaceChildren();
    const scale = Math.max(1, ...state.workers.map(w =>
      Math.max(w.memory.limit, w.memory.managed + w.memory.unmanaged + w.memory.spilled)));
    const most = Math.max(1, ...state.workers.map(w => w.processing));
    for (const w of state.workers) {
      const m = w.memory, colour = memoryColour(w, th);
      const bar = el("div", "hbar");
      bar.append(seg("managed", m.managed / scale, colour, "managed " + fmtBytes(m.managed)),
                 seg("unmanaged", m.unmanaged / scale, colour, "unmanaged " + fmtBytes(m.unmanaged)),
                 seg("spilled", m.spilled / scale, "#9a9a9a", "spilled " + fmtBytes(m.spilled)));
      mem.append(row(w.worker, bar, fmtBytes(m.managed + m.unmanaged) + (m.spilled ? " + " + fmtBytes(m.spilled) + " spilled" : ""),
                     {worker: w.worker, colour}));
      const pbar = el("div", "hbar");
      pbar.append(seg("processing", w.processing / most, "#5b8cc8", w.processing + " processing"));
      proc.append(row(w.worker, pbar, String(w.processing), {worker: w.worker, processing: w.processing}));
    }
    for (const p of state.prefixes) {
      const total = p.waiting + p.processing + p.memory + p.released + p.erred;
      const colour = opts.colours[p.prefix] || "#888";
      const bar = el("div", "hbar");
      if (total) {
        const hatch = `repeating-linear-gradient(45deg, ${colour} 0 3px, #fff 3px 6px)`;
        bar.append(seg("released", p.released / total, colour, p.released + " released"),
                   seg("memory", p.memory / total, colour, p.memory + " in memory"),
                   seg("erred", p.erred / total, "#000", p.erred + " erred"),
                   seg("processing", p.processing / total, hatch, p.processing + " processing"),
                   seg("waiting", p.waiting / total, "#c8c8c8", p.waiting + " waiting"));
      }
      const done = p.memory + p.released + p.erred;
      prog.append(row(p.prefix, bar, `${done} / ${total}`, {prefix: p.prefix,
        counts: [p.waiting, p.processing, p.memory, p.released, p.erred].join(",")}));
    }
    if (!state.prefixes.length) prog.append(el("p", "", "No sample at this moment."));
  }

  // The task stream up to t: tasks not started yet hidden, running ones cut at t. A big
  // run's stream comes in windows (hindsight.js): each new one is cut at the time shown.
  let cutAt = null;
  document.addEventListener("hs-stream-window", e => {
    if (e.detail !== "task-stream-source") return;
    stream = null;
    if (cutAt !== null) streamUpTo(cutAt);
  });
  function streamUpTo(t) {
    cutAt = t;
    let source = null;
    for (const doc of Bokeh.documents) {
      source = doc.get_model_by_name("task-stream-source");
      if (source) break;
    }
    if (!source || !source.data.x) return;
    if (stream === null || stream.source !== source) {
      const d = source.data;
      stream = {source, x: Float64Array.from(d.x), width: Float64Array.from(d.width), alpha: Float64Array.from(d.alpha)};
    }
    const rel = t - opts.origin, n = stream.x.length;
    const x = new Float64Array(n), width = new Float64Array(n), alpha = new Float64Array(n);
    for (let i = 0; i < n; i++) {
      const start = stream.x[i] - stream.width[i] / 2, stop = start + stream.width[i];
      if (start > rel) { x[i] = stream.x[i]; width[i] = stream.width[i]; alpha[i] = 0; continue; }
      const end = Math.min(stop, rel);
      x[i] = (start + end) / 2; width[i] = end - start; alpha[i] = stream.alpha[i];
    }
    setStream("task-stream-source", {...source.data, x, width, alpha});
    for (const doc of Bokeh.documents) {
      const cursor = doc.get_model_by_name("replay-cursor");
      if (cursor) { cursor.location = rel; cursor.visible = true; }
    }
  }

  async function show(t) {
    const n = ++asked;
    label.textContent = new Date(t * 1000).toISOString().replace("T", " ").slice(0, 23) +
      " UTC (" + (t - opts.run_start).toFixed(1) + " s into the run)";
    try {
      const r = await fetch(`${opts.url}?at=${t}`, {credentials: "same-origin", cache: "no-store"});
      if (!r.ok) { label.textContent += " (server answered " + r.status + ")"; return; }
      const state = await r.json();
      if (n < shown) return;  // a later answer was drawn already
      shown = n;
      draw(state);
      streamUpTo(t);
      document.getElementById("replay").dataset.shown = String(n);
      document.getElementById("replay").dataset.at = String(t);
    } catch (e) {
      label.textContent += " (server unreachable)";
    }
  }

  // The slider is in seconds from the run's first sample; its far end is the last sample
  // exactly (a float round trip must not land just before it).
  const timeOf = () => {
    const v = parseFloat(slider.value), max = parseFloat(slider.max);
    return v >= max ? opts.last : opts.start + v;
  };
  slider.addEventListener("input", () => {
    clearTimeout(timer);
    timer = setTimeout(() => show(timeOf()), 40);
  });
  window.hsReplay = {show};
  show(timeOf());
}
