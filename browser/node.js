// edgerun browser node: a pipeline worker in a web page.
//
// It speaks the pipeline frames of edgerun/net/wire.py over the master's WebSocket, downloads the
// stage it is given (ONNX graph and weights, named by sha256), runs it with onnxruntime-web (WebGPU
// where the browser has it, WebAssembly otherwise) and answers each forward pass; as the last stage
// it samples (sampling.js, the same draws as a native worker) and returns only the token id. The
// cluster secret comes from the page's fragment (#key=...), which never reaches the server.

import * as ort from "/ort/ort.all.min.mjs";
import {Msg, clusterKey, openFrame, packFrame, sha256Hex} from "/frames.js";
import {KernelStage, kernelsSupported} from "/kernels.js";
import {sample} from "/sampling.js";

const params = new URLSearchParams(location.search);
ort.env.wasm.wasmPaths = "/ort/";
// Threads need the page cross-origin isolated (the master serves it so); ?threads=N overrides, up to the cores.
const cores = navigator.hardwareConcurrency || 1;
const threads = crossOriginIsolated ? Math.max(1, Math.min(Number(params.get("threads") || cores), cores)) : 1;
ort.env.wasm.numThreads = threads;
ort.env.wasm.simd = true;
const secret = new URLSearchParams(location.hash.slice(1)).get("key") || "";
const key = clusterKey(secret);
// WebGPU where the browser has an adapter for it (navigator.gpu alone may have none), WebAssembly otherwise.
const adapter = navigator.gpu ? await navigator.gpu.requestAdapter().catch(() => null) : null;
// The stage's matrices: "q4" as the model file stores them, in an ONNX graph (MatMulNBits; WebGPU has a kernel for
// it); without WebGPU, "kernels": quantized as the file stores them, for edgerun's own WebAssembly kernels
// (kernels.js; the master sends stage.bin), where the browser has relaxed SIMD; else "f32" dequantized by the
// master (several times the memory): onnxruntime-web's WebAssembly has no MatMulNBits kernel of its own and
// dequantizes every matrix on every pass, 20-30x slower than its float32 MatMul. ?weights= overrides.
const weights = params.get("weights") || (adapter ? "q4" : await kernelsSupported() ? "kernels" : "f32");
// The kernels compute on the page's own thread (onnxruntime-web's threads are its own).
const computeThreads = weights === "kernels" ? 1 : threads;
const status = {connected: false, backend: adapter ? "webgpu" : "wasm", threads: computeThreads, weights, layers: "-",
                passes: 0, lastMs: 0, error: ""};
window.edgerunStatus = status;

function show() {
  const el = document.getElementById("status");
  if (el) {
    el.textContent = `connected: ${status.connected}\nbackend: ${status.backend} (${status.threads} ` +
      `thread(s), ${status.weights} weights)\nlayers: ${status.layers}\n` +
      `passes served: ${status.passes}\nlast pass: ${status.lastMs.toFixed(1)} ms\n` +
      (status.error ? `error: ${status.error}\n` : "");
  }
}

async function fetchFile(sha) {
  const url = `/files/${sha}`;
  const cache = "caches" in window ? await caches.open("edgerun-files") : null; // across restarts
  let response = cache ? await cache.match(url) : undefined;
  if (!response) {
    response = await fetch(url);
    if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
    // A file the cache cannot take (over the origin's quota) is used all the same, only fetched again next time.
    if (cache) await cache.put(url, response.clone()).catch(() => {});
  }
  const bytes = new Uint8Array(await response.arrayBuffer());
  if (await sha256Hex(bytes) !== sha) throw new Error(`file ${sha.slice(0, 12)} arrived with another hash`);
  return bytes;
}

class Stage {
  constructor(spec, config, maxLen) {
    this.spec = spec;
    this.config = config;
    this.maxLen = maxLen;
    this.position = 0;
    this.kv = {};
  }

  // The KV cache is handed to onnxruntime-web as past tensors holding exactly the positions cached so far,
  // and comes back one position longer (present): the attention kernel then copies what the context holds,
  // not a buffer of the whole context length, into and out of the WebAssembly heap on every pass.
  savePrefix() {
    this.prefix = {length: this.position, kv: {...this.kv}}; // tensors are not changed in place: no copies
  }

  restorePrefix() {
    if (!this.prefix) throw new Error("no prefix saved");
    this.kv = {...this.prefix.kv};
    this.position = this.prefix.length;
  }

  reset() {
    this.position = 0;
    const c = this.config;
    for (let i = this.spec.first_layer; i < this.spec.end_layer; i++) {
      for (const kind of ["key", "value"]) {
        this.kv[`past_${kind}_${i}`] = new ort.Tensor("float32", new Float32Array(0), [1, c.n_kv_heads, 0, c.head_dim]);
      }
    }
  }

  async load(files) {
    const providers = status.backend === "webgpu" ? ["webgpu", "wasm"] : ["wasm"];
    this.session = await ort.InferenceSession.create(files["model.onnx"], {
      executionProviders: providers, externalData: [{path: "weights.bin", data: files["weights.bin"]}]});
    this.reset();
  }

  async run(x) { // x: {dtype, shape, data}
    const total = this.position + x.shape[1];
    if (total > this.maxLen) throw new Error(`context of ${this.maxLen} tokens exceeded`);
    const feeds = {...this.kv};
    feeds[this.session.inputNames[0]] = new ort.Tensor(x.dtype, x.data, x.shape);
    feeds.seqlens_k = new ort.Tensor("int32", new Int32Array([total - 1]), [1]);
    feeds.total_seq_len = new ort.Tensor("int32", new Int32Array([total]), []);
    const out = await this.session.run(feeds);
    for (let i = this.spec.first_layer; i < this.spec.end_layer; i++) { // present becomes the next past
      this.kv[`past_key_${i}`] = out[`present_key_${i}`];
      this.kv[`past_value_${i}`] = out[`present_value_${i}`];
    }
    this.position = total;
    return out[this.session.outputNames[0]];
  }
}

function start() {
  const ws = new WebSocket(`${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/ws`);
  ws.binaryType = "arraybuffer";
  let config = null, maxLen = 0, prepared = null, stage = null;
  const send = (type, request, message, tensors) => ws.send(packFrame(key, type, request, message, tensors));
  ws.onopen = () => { status.connected = true; show(); };
  ws.onclose = () => { status.connected = false; show(); };
  let queue = Promise.resolve(); // messages are handled one at a time, in order
  ws.onmessage = (event) => {
    let frame;
    try {
      frame = openFrame(key, event.data);
    } catch (e) {
      status.error = `dropped a frame: ${e.message}`;
      show();
      return;
    }
    const report = (e) => { status.error = String(e); show(); };
    if (frame.type === Msg.PING) { // at once, beside the queue: it measures the link, not the queue
      send(Msg.PONG, frame.request, {});
    } else if (frame.type === Msg.DOWNLOAD_LAYERS) { // beside the queue: the stage held now keeps serving
      handle(frame).catch(report);
    } else {
      queue = queue.then(() => handle(frame)).catch(report);
    }
  };

  async function handle({type, request, message, tensors}) {
    try {
      if (type === Msg.INIT) {
        config = message.config;
        maxLen = message.max_len;
        const memory = Number(params.get("memory") || (navigator.deviceMemory || 2) * 1024);
        send(Msg.CONNECT, request, {name: params.get("name") || `browser-${Math.floor(Math.random() * 1e6)}`,
          memory_mb: memory, speed: Number(params.get("speed") || 2e8),
          capabilities: {kind: "browser", runtime: weights === "kernels" ? "edgerun-kernels" : "onnxruntime-web",
                         backend: status.backend, threads: computeThreads, weights},
          cached: []});
      } else if (type === Msg.DOWNLOAD_LAYERS) {
        for (const sha of message.files) {
          const started = performance.now();
          const bytes = await fetchFile(sha);
          send(Msg.LAYER_DOWNLOAD, request, {sha256: sha, seconds: (performance.now() - started) / 1000,
                                             bytes: bytes.length});
        }
      } else if (type === Msg.PREPARE_MODEL) {
        const files = {};
        for (const f of message.files) files[f.name] = await fetchFile(f.sha256);
        prepared = {spec: message.stage, files};
        stage = null;
        status.layers = `${message.stage.first_layer}-${message.stage.end_layer - 1}`;
        show();
        send(Msg.PREPARE_DONE, request, {});
      } else if (type === Msg.COMMIT_MODEL) {
        const started = performance.now();
        // stage.bin: a stage for the WebAssembly kernels (the master sends it to a tab that asked for them).
        const Runner = prepared.files["stage.bin"] ? KernelStage : Stage;
        stage = new Runner(prepared.spec, config, Number(message.max_len || maxLen));
        await stage.load(prepared.files);
        send(Msg.COMMIT_DONE, request, {seconds: (performance.now() - started) / 1000});
      } else if (type === Msg.COMPUTATION) {
        if (!stage) throw new Error("no stage loaded");
        if (message.prefix === "restore") stage.restorePrefix();
        else if (message.position === 0) stage.reset();
        if (message.position !== stage.position) {
          throw new Error(`input at position ${message.position}, but the cache holds ${stage.position}`);
        }
        const started = performance.now();
        const out = await stage.run(tensors.input_ids || tensors.hidden);
        const seconds = (performance.now() - started) / 1000;
        if (message.prefix === "save") stage.savePrefix();
        status.passes += 1;
        status.lastMs = seconds * 1000;
        show();
        const sampling = message.sampling || {};
        const vocab = out.dims[out.dims.length - 1];
        if (stage.spec.lm_head && sampling.logits) { // the master draws (a grammar, penalties, logprobs)
          send(Msg.COMPUTATION_RESULT, request, {seconds},
               {logits: {dtype: "float32", shape: [vocab], data: out.data.slice(out.data.length - vocab)}});
        } else if (stage.spec.lm_head) { // the token after the input's last one, from that one's logits
          const token = sample(out.data.subarray(out.data.length - vocab), sampling, message.position + out.dims[1]);
          send(Msg.COMPUTATION_RESULT, request, {token, seconds});
        } else {
          send(Msg.COMPUTATION_RESULT, request, {seconds},
               {hidden: {dtype: "float32", shape: out.dims, data: out.data}});
        }
      } else if (type === Msg.INVALIDATE_CACHE) {
        if (stage) stage.reset();
      } else if (type === Msg.RELEASE_SESSION) {
        stage = null;
        prepared = null;
        status.layers = "-";
        show();
      }
    } catch (e) {
      status.error = String(e.message || e);
      show();
      send(Msg.ERROR, request, {error: status.error});
    }
  }
}

show();
if (params.get("mode") === "moe") { // an expert worker of a MoEx hub (edgerun master --plan moe)
  const {startExperts} = await import("/expert.js");
  startExperts({ort, key, params, status, show});
} else {
  start();
}
