// A pipeline stage computed with edgerun's own WebAssembly kernels (kernels.wat): the matrices stay quantized as
// the master's stage.bin holds them (edgerun/model/kernel_stage.py says the layout), and each product takes int8
// activations quantized per block of 32, as onnxruntime's MatMulNBits does natively. The products, the
// activations' quantization and attention's two loops over the KV cache (scores, weighted values) are kernels;
// norms, biases, rotary embedding, softmax and the MLP's gate (SwiGLU, Gemma's GeGLU) are plain JavaScript: a few
// thousand operations a layer, against
// millions in the products. A prefill runs token by token: the products are bound by the kernels' arithmetic,
// not by reading the matrices (16 tokens to one reading of each matrix measured no faster). The numpy replica
// of all of it is edgerun/model/kernel_reference.py.
//
// The interface is node.js's Stage's: reset, savePrefix, restorePrefix, run(x) -> {dims, data}.

const BLOCK = 32;

// Whether this browser runs the kernels (WebAssembly SIMD with the relaxed integer dot product).
export async function kernelsSupported() {
  try {
    return WebAssembly.validate(await kernelBytes());
  } catch {
    return false;
  }
}

let kernelBytesPromise = null;
function kernelBytes() {
  kernelBytesPromise ??= fetch("/kernels.wasm").then((r) => {
    if (!r.ok) throw new Error(`/kernels.wasm: HTTP ${r.status}`);
    return r.arrayBuffer();
  });
  return kernelBytesPromise;
}

function parseStage(bytes) {
  const magic = String.fromCharCode(...bytes.subarray(0, 4));
  if (magic !== "ERK1") throw new Error("stage.bin is not a kernel stage");
  const length = new DataView(bytes.buffer, bytes.byteOffset).getUint32(4, true);
  const header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + length)));
  const start = 8 + length + ((64 - ((8 + length) % 64)) % 64);
  return {header, data: bytes.subarray(start)};
}

export class KernelStage {
  constructor(spec, config, maxLen) {
    this.spec = spec;
    this.config = config;
    this.maxLen = maxLen;
    this.position = 0;
    this.prefix = null;
  }

  async load(files) {
    const {header, data} = parseStage(files["stage.bin"]);
    const h = this.h = header;
    if (h.format !== 2) throw new Error(`stage.bin format ${h.format}; this page reads format 2`);
    if (h.first_layer !== this.spec.first_layer || h.end_layer !== this.spec.end_layer) {
      throw new Error(`stage.bin holds layers ${h.first_layer}-${h.end_layer - 1}, not the stage's`);
    }
    // The heap: the tensors, then the activation and output buffers. A layer's products of one input (q, k, v;
    // gate, up) are one product over their rows laid end to end (codes, then scales, then offsets), where their
    // blocks agree; the tied embedding and head are one copy.
    let top = 64;
    const copies = new Map(); // file offset -> [heap address, bytes]
    const placeRun = (names) => { // these tensors end to end; the address of the first
      const first = copies.get(h.tensors[names[0]].offset);
      if (first) return first[0];
      const start = top;
      for (const name of names) {
        const t = h.tensors[name];
        copies.set(t.offset, [top, t.bytes]);
        top += t.bytes;
      }
      top = start + Math.ceil((top - start) / 64) * 64;
      return start;
    };
    const vectors = {}; // the tensors of no matrix: norm weights
    for (const [name, t] of Object.entries(h.tensors)) {
      if (!(name.replace(/\.(codes|scales|offsets)$/, "") in h.matrices)) {
        vectors[name] = {address: placeRun([name]), bytes: t.bytes};
      }
    }
    this.groups = {};
    const group = (key, names) => { // one product descriptor per run of matrices that agree
      const runs = [];
      for (const name of names) {
        const m = h.matrices[name], last = runs[runs.length - 1];
        if (last && last.bits === m.bits && last.cols === m.cols && last.offsets === m.offsets) last.names.push(name);
        else runs.push({bits: m.bits, cols: m.cols, offsets: m.offsets, names: [name]});
      }
      this.groups[key] = runs.map((r) => ({
        bits: r.bits, cols: r.cols, parts: r.names.map((n) => h.matrices[n].rows),
        rows: r.names.reduce((sum, n) => sum + h.matrices[n].rows, 0),
        codes: placeRun(r.names.map((n) => `${n}.codes`)), scales: placeRun(r.names.map((n) => `${n}.scales`)),
        offsets: r.offsets ? placeRun(r.names.map((n) => `${n}.offsets`)) : 0}));
    };
    if (h.embed) group("token_embd", ["token_embd"]);
    for (let i = h.first_layer; i < h.end_layer; i++) {
      group(`${i}.qkv`, [`${i}.wq`, `${i}.wk`, `${i}.wv`]);
      group(`${i}.wo`, [`${i}.wo`]);
      group(`${i}.gate_up`, [`${i}.w_gate`, `${i}.w_up`]);
      group(`${i}.w_down`, [`${i}.w_down`]);
    }
    if (h.lm_head) group("output", ["output"]);
    const place = (bytes) => { const at = top; top += Math.ceil(bytes / 64) * 64; return at; };
    const widest = Math.max(h.hidden, h.ffn, h.n_heads * h.head_dim);
    const blocks = widest / BLOCK;
    this.act = {x: place(4 * widest), aq: place(widest), sa: place(4 * blocks), corr: place(4 * blocks),
                asum: place(4 * blocks)};
    const rowsMax = Math.max(2 * h.ffn, (h.n_heads + 2 * h.n_kv_heads) * h.head_dim, h.lm_head ? h.vocab : 0);
    this.outAddress = place(4 * rowsMax);
    // Attention: the query, each head's scores (then weights) over the positions, the heads' outputs, and per
    // layer the KV cache, (kv heads, max_len, head_dim) each.
    const d = h.head_dim, kvFloats = h.n_kv_heads * this.maxLen * d;
    this.att = {q: place(4 * h.n_heads * d), scores: place(4 * this.maxLen), out: place(4 * h.n_heads * d)};
    this.keys = [];
    this.values = [];
    for (let i = h.first_layer; i < h.end_layer; i++) {
      this.keys.push(place(4 * kvFloats));
      this.values.push(place(4 * kvFloats));
    }
    const {instance} = await WebAssembly.instantiate(await kernelBytes(), {});
    this.kernels = instance.exports;
    const memory = this.kernels.memory;
    memory.grow(Math.ceil(Math.max(0, top - memory.buffer.byteLength) / 65536));
    const heap = new Uint8Array(memory.buffer);
    for (const [offset, [address, bytes]] of copies) heap.set(data.subarray(offset, offset + bytes), address);
    this.u8 = heap;
    this.i8 = new Int8Array(memory.buffer);
    this.f32 = new Float32Array(memory.buffer);
    this.vectors = Object.fromEntries(Object.entries(vectors).map(([name, v]) =>
      [name, this.f32.subarray(v.address / 4, (v.address + v.bytes) / 4)]));
    const half = h.head_dim / 2;
    // Each layer's rotation: its base (Gemma's windowed layers have their own) and position scale (linear RoPE
    // scaling); Llama 3's files divide each rotary pair's frequency by a factor (rope_freqs).
    this.rotations = h.rope_bases.map((base, k) => ({scale: h.rope_scales[k], invFreq: Float64Array.from({length: half},
      (_, i) => 1 / base ** ((2 * i) / h.head_dim) / (h.rope_freqs ? h.rope_freqs[i] : 1))}));
    this.embedScale = Math.fround(h.embed_scale);
    this.queryScale = Math.fround(h.query_scale);
    this.reset();
  }

  reset() {
    this.position = 0;
  }

  // The prefix (the chat template's start, computed once): a copy of its rows of every layer's cache, which a
  // request from position 0 overwrites.
  savePrefix() {
    const d = this.h.head_dim, n = this.position;
    const rows = (cache) => Array.from({length: this.h.n_kv_heads}, (_, kv) =>
      this.f32.slice(cache / 4 + kv * this.maxLen * d, cache / 4 + (kv * this.maxLen + n) * d));
    this.prefix = {length: n, keys: this.keys.map(rows), values: this.values.map(rows)};
  }

  restorePrefix() {
    if (!this.prefix) throw new Error("no prefix saved");
    const d = this.h.head_dim;
    for (const [saved, caches] of [[this.prefix.keys, this.keys], [this.prefix.values, this.values]]) {
      saved.forEach((heads, layer) => heads.forEach((rows, kv) => this.f32.set(rows, caches[layer] / 4 +
                                                                                        kv * this.maxLen * d)));
    }
    this.position = this.prefix.length;
  }

  // x: {dtype, shape: [1, seq(, hidden)], data}. Returns the hidden states of every token, or for the last stage
  // the logits of the last token ({dims: [1, seq, vocab]} with only that row in data).
  run(x) {
    const h = this.h, seq = x.shape[1];
    if (this.position + seq > this.maxLen) throw new Error(`context of ${this.maxLen} tokens exceeded`);
    const out = h.lm_head ? null : new Float32Array(seq * h.hidden);
    let logits = null;
    for (let t = 0; t < seq; t++) {
      const hidden = h.embed ? this.embed(Number(x.data[t])) : Float32Array.from(x.data.subarray(t * h.hidden,
                                                                                                  (t + 1) * h.hidden));
      for (let i = h.first_layer; i < h.end_layer; i++) this.layer(i, hidden, this.position);
      this.position += 1;
      if (out) out.set(hidden, t * h.hidden);
      else if (t === seq - 1) logits = this.head(hidden);
    }
    return out ? {dims: [1, seq, h.hidden], data: out} : {dims: [1, seq, h.vocab], data: logits};
  }

  embed(token) {
    const [m] = this.groups.token_embd;
    if (!(token >= 0 && token < m.rows)) throw new Error(`token ${token} outside the vocabulary`);
    const nb = m.cols / BLOCK, row = new Float32Array(m.cols);
    const codes = m.codes + token * nb * (m.bits === 4 ? 16 : 32), scales = m.scales / 4 + token * nb;
    for (let b = 0; b < nb; b++) {
      const s = this.f32[scales + b], o = m.offsets ? this.f32[m.offsets / 4 + token * nb + b] : 0;
      for (let j = 0; j < BLOCK; j++) {
        let code;
        if (m.bits === 8) code = this.i8[codes + b * 32 + j];
        else code = (j < 16 ? this.u8[codes + b * 16 + j] & 15 : this.u8[codes + b * 16 + j - 16] >> 4) - 8;
        row[b * BLOCK + j] = Math.fround(Math.fround(s * code) + o);
      }
    }
    if (this.embedScale !== 1) for (let j = 0; j < m.cols; j++) row[j] *= this.embedScale; // Gemma: sqrt(hidden)
    return row;
  }

  // The products of a group's matrices (products' groups in load) with the activation in the heap's input buffer
  // (`length` floats at act.x), each quantized once for its bits: views of the output buffer, one per matrix, in
  // order, valid until the next call.
  products(key, length) {
    const {x, aq, sa, corr, asum} = this.act, views = [];
    let out = this.outAddress, bits = 0;
    for (const m of this.groups[key]) {
      if (m.bits !== bits) this.kernels.quantize(x, length / BLOCK, m.bits === 4 ? 8 : 0, aq, sa, corr, asum);
      bits = m.bits;
      this.kernels.gemv(m.bits, m.codes, m.scales, m.offsets, aq, sa, corr, asum, out, m.rows, m.cols / BLOCK);
      for (const rows of m.parts) {
        views.push(this.f32.subarray(out / 4, out / 4 + rows));
        out += 4 * rows;
      }
    }
    return views;
  }

  // The products' input buffer as a view, for a step to write its activation into.
  input(length) {
    return this.f32.subarray(this.act.x / 4, this.act.x / 4 + length);
  }

  // x normalized into `out` (by default the products' input buffer, which it returns).
  rmsNorm(x, weight, out = this.input(x.length)) {
    let sum = 0;
    for (let i = 0; i < x.length; i++) sum += x[i] * x[i];
    const inverse = 1 / Math.sqrt(sum / x.length + this.h.norm_eps);
    for (let i = 0; i < x.length; i++) out[i] = x[i] * inverse * weight[i];
    return out;
  }

  // Qwen3: each head's query or key normalized in place.
  headNorms(x, heads, weight) {
    const d = this.h.head_dim;
    for (let hd = 0; hd < heads; hd++) this.rmsNorm(x.subarray(hd * d, (hd + 1) * d), weight, x.subarray(hd * d));
  }

  rope(x, heads, position, rotation) {
    const d = this.h.head_dim, half = d / 2, at = position * rotation.scale;
    for (let i = 0; i < half; i++) {
      const angle = at * rotation.invFreq[i], c = Math.fround(Math.cos(angle)), s = Math.fround(Math.sin(angle));
      for (let hd = 0; hd < heads; hd++) {
        const a = x[hd * d + i], b = x[hd * d + i + half];
        x[hd * d + i] = a * c - b * s;
        x[hd * d + i + half] = b * c + a * s;
      }
    }
  }

  layer(i, hidden, position) {
    const h = this.h, d = h.head_dim, k = i - h.first_layer, vector = (name) => this.vectors[`${i}.${name}`];
    this.rmsNorm(hidden, vector("attn_norm"));
    const [q, key, value] = this.products(`${i}.qkv`, h.hidden);
    if (vector("bq")) { // Qwen2
      for (const [x, bias] of [[q, vector("bq")], [key, vector("bk")], [value, vector("bv")]]) {
        for (let j = 0; j < x.length; j++) x[j] += bias[j];
      }
    }
    if (vector("q_norm")) { // Qwen3
      this.headNorms(q, h.n_heads, vector("q_norm"));
      this.headNorms(key, h.n_kv_heads, vector("k_norm"));
    }
    this.rope(q, h.n_heads, position, this.rotations[k]);
    this.rope(key, h.n_kv_heads, position, this.rotations[k]);
    if (h.query_scale) for (let j = 0; j < q.length; j++) q[j] *= this.queryScale; // Gemma, after the rotation
    const keys = this.keys[k], values = this.values[k];
    for (let kv = 0; kv < h.n_kv_heads; kv++) {
      this.f32.set(key.subarray(kv * d, (kv + 1) * d), keys / 4 + (kv * this.maxLen + position) * d);
      this.f32.set(value.subarray(kv * d, (kv + 1) * d), values / 4 + (kv * this.maxLen + position) * d);
    }
    // Per head: the scores over the positions (kernels.wat), their softmax here, the weighted values (kernels.wat)
    // straight into the products' input buffer. A windowed layer (Gemma's) sees its last `window` positions.
    const first = h.windows[k] ? Math.max(0, position + 1 - h.windows[k]) : 0;
    const att = this.att, positions = position + 1 - first, group = h.n_heads / h.n_kv_heads;
    const scores = this.f32.subarray(att.scores / 4, att.scores / 4 + positions);
    const scale = h.query_scale ? 1 : 1 / Math.sqrt(d);
    this.f32.set(q, att.q / 4);
    for (let head = 0; head < h.n_heads; head++) {
      const kv = (Math.floor(head / group) * this.maxLen + first) * d * 4;
      this.kernels.scores(att.q + head * d * 4, keys + kv, att.scores, positions, d, scale);
      let top = -Infinity, total = 0;
      for (let t = 0; t < positions; t++) top = Math.max(top, scores[t]);
      for (let t = 0; t < positions; t++) total += (scores[t] = Math.exp(scores[t] - top));
      for (let t = 0; t < positions; t++) scores[t] /= total;
      this.kernels.mix(att.scores, values + kv, this.act.x + head * d * 4, positions, d);
    }
    const [projected] = this.products(`${i}.wo`, h.n_heads * d);
    this.addInto(hidden, projected, vector("attn_post_norm"));
    this.rmsNorm(hidden, vector("ffn_norm"));
    const [gate, up] = this.products(`${i}.gate_up`, h.hidden), act = this.input(h.ffn);
    if (h.activation === "gelu_tanh") { // Gemma: GELU's tanh approximation
      const c = Math.sqrt(2 / Math.PI);
      for (let j = 0; j < h.ffn; j++) {
        const g = gate[j];
        act[j] = 0.5 * g * (1 + Math.tanh(c * (g + 0.044715 * g * g * g))) * up[j];
      }
    } else {
      for (let j = 0; j < h.ffn; j++) act[j] = (gate[j] / (1 + Math.exp(-gate[j]))) * up[j];
    }
    const [down] = this.products(`${i}.w_down`, h.ffn);
    this.addInto(hidden, down, vector("ffn_post_norm"));
  }

  // hidden += out, normalized first where the layer has a norm after it (Gemma).
  addInto(hidden, out, norm) {
    const add = norm ? this.rmsNorm(out, norm) : out;
    for (let j = 0; j < hidden.length; j++) hidden[j] += add[j];
  }

  head(hidden) {
    this.rmsNorm(hidden, this.vectors.output_norm);
    return Float32Array.from(this.products("output", this.h.hidden)[0]);
  }
}
