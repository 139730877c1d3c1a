// Shared by the dashboard pages.
// Big columns arrive compact (typed arrays in base64; keys, labels and colours once) and
// are expanded into the figures' sources once those exist.
function typed(b64, T) {
  const bin = atob(b64), bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  return new T(bytes.buffer);
}
function expandStream(p) {
  const c = typed(p.c, Int32Array), k = typed(p.k, Int32Array), n = typed(p.n, Int32Array);
  const colour = new Array(p.count), alpha = new Float64Array(p.count), key = new Array(p.count), name = new Array(p.count);
  for (let i = 0; i < p.count; i++) {
    const ca = p.colours[c[i]]; colour[i] = ca[0]; alpha[i] = ca[1];
    key[i] = p.keys[k[i]]; name[i] = p.names[n[i]];
  }
  return {x: typed(p.x, Float64Array), width: typed(p.width, Float64Array), y: typed(p.y, Int32Array),
          colour, alpha, key, name};
}
function fill(sources) {
  for (const [name, payload] of Object.entries(sources)) {
    for (const doc of Bokeh.documents) {
      const model = doc.get_model_by_name(name);
      if (model) { model.data = expandStream(payload); break; }
    }
  }
}
const painted = () => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
