// edgerun browser node in expert mode (node?mode=moe): an expert worker of a MoEx hub.
//
// It speaks the MoEx frames of edgerun/net/wire.py (the MoEx paper's 28-byte header, HMAC-SHA256 like every frame)
// over the hub's /moe WebSocket: it says who it is (HEARTBEAT), holds the experts a WEIGHT_SYNC lists (each an
// ONNX graph with float32 weights, fetched by sha256 from /files and run by onnxruntime-web), answers each
// DISPATCH with the gate-weighted output (RESULT) and skips a dispatch the hub CANCELs before it starts.

import {hex, hmacSha256, sha256Hex} from "/frames.js";

const MAGIC = [0x4d, 0x6f, 0x45, 0x78]; // "MoEx"
const VERSION = 1;
const HEADER = 28;
const MAC_SIZE = 16;
const F32 = 5;
export const Moex = {DISPATCH: 1, RESULT: 2, CANCEL: 3, HEARTBEAT: 4, WEIGHT_SYNC: 5};

function concat(...parts) {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let offset = 0;
  for (const p of parts) { out.set(p, offset); offset += p.length; }
  return out;
}

export function packMoex(key, type, seq, {layer = 0, expert = 0, tokens = 0, hidden = 0, dtype = F32,
                                          payload = new Uint8Array(0)} = {}) {
  const header = new Uint8Array(HEADER);
  const view = new DataView(header.buffer);
  header.set(MAGIC, 0);
  view.setUint16(4, VERSION, true);
  view.setUint16(6, type, true);
  view.setUint32(8, payload.length, true);
  view.setUint32(12, seq, true);
  view.setUint16(16, layer, true);
  view.setUint16(18, expert, true);
  view.setUint32(20, tokens, true);
  view.setUint16(24, hidden, true);
  view.setUint8(26, dtype);
  view.setUint8(27, 0);
  const body = concat(header, payload);
  return concat(body, hmacSha256(key, body).slice(0, MAC_SIZE));
}

export function openMoex(key, buffer) {
  const bytes = new Uint8Array(buffer);
  if (bytes.length < HEADER + MAC_SIZE) throw new Error("frame too short");
  const body = bytes.subarray(0, bytes.length - MAC_SIZE);
  if (hex(hmacSha256(key, body).slice(0, MAC_SIZE)) !== hex(bytes.subarray(bytes.length - MAC_SIZE))) {
    throw new Error("bad MAC (wrong cluster key?)");
  }
  const view = new DataView(body.buffer, body.byteOffset, body.byteLength);
  if (MAGIC.some((b, i) => body[i] !== b)) throw new Error("bad magic");
  if (view.getUint16(4, true) !== VERSION) throw new Error(`MoEx version ${view.getUint16(4, true)}`);
  const length = view.getUint32(8, true);
  if (length !== body.length - HEADER) throw new Error("payload length does not match the frame");
  return {type: view.getUint16(6, true), seq: view.getUint32(12, true), layer: view.getUint16(16, true),
          expert: view.getUint16(18, true), tokens: view.getUint32(20, true), hidden: view.getUint16(24, true),
          dtype: view.getUint8(26), payload: body.slice(HEADER)}; // a copy: aligned for typed arrays
}

const json = (value) => new TextEncoder().encode(JSON.stringify(value));

async function fetchFile(sha) {
  const response = await fetch(`/files/${sha}`);
  if (!response.ok) throw new Error(`/files/${sha}: HTTP ${response.status}`);
  const bytes = new Uint8Array(await response.arrayBuffer());
  if (await sha256Hex(bytes) !== sha) throw new Error(`file ${sha.slice(0, 12)} arrived with another hash`);
  return bytes;
}

export function startExperts({ort, key, params, status, show}) {
  const ws = new WebSocket(`${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/moe`);
  ws.binaryType = "arraybuffer";
  const sessions = new Map(); // "layer:expert" -> onnxruntime-web session
  const cancelled = new Set();
  const name = params.get("name") || `browser-${Math.floor(Math.random() * 1e6)}`;
  const budget = Number(params.get("memory") || (navigator.deviceMemory || 2) * 1024);
  const send = (type, seq, fields) => ws.send(packMoex(key, type, seq, fields));
  status.layers = "experts: 0";
  ws.onopen = () => {
    status.connected = true;
    show();
    send(Moex.HEARTBEAT, 0, {payload: json({name, budget_mb: budget, kind: "browser", backend: "wasm"})});
  };
  ws.onclose = () => { status.connected = false; show(); };
  let queue = Promise.resolve(); // frames are handled one at a time, in order
  ws.onmessage = (event) => {
    let frame;
    try {
      frame = openMoex(key, event.data);
    } catch (e) {
      status.error = `dropped a frame: ${e.message}`;
      show();
      return;
    }
    if (frame.type === Moex.CANCEL) { // at once: the dispatch it names may still wait in the queue
      cancelled.add(frame.seq);
      return;
    }
    queue = queue.then(() => handle(frame)).catch((e) => { status.error = String(e.message || e); show(); });
  };

  async function handle(frame) {
    if (frame.type === Moex.WEIGHT_SYNC) {
      const info = JSON.parse(new TextDecoder().decode(frame.payload));
      const wanted = new Set();
      try {
        for (const {layer, expert, graph, weights} of info.experts) {
          const id = `${layer}:${expert}`;
          wanted.add(id);
          if (sessions.has(id)) continue;
          const [model, data] = [await fetchFile(graph), await fetchFile(weights)];
          sessions.set(id, await ort.InferenceSession.create(model, {
            executionProviders: ["wasm"], externalData: [{path: "expert.bin", data}]}));
        }
        for (const id of [...sessions.keys()]) if (!wanted.has(id)) sessions.delete(id);
        status.layers = `experts: ${sessions.size}`;
        show();
        send(Moex.HEARTBEAT, frame.seq, {payload: json({ready: true, experts: sessions.size})});
      } catch (e) {
        send(Moex.HEARTBEAT, frame.seq, {payload: json({ready: false, error: String(e.message || e)})});
      }
    } else if (frame.type === Moex.DISPATCH) {
      if (cancelled.delete(frame.seq)) return;
      const session = sessions.get(`${frame.layer}:${frame.expert}`);
      if (!session || frame.dtype !== F32) throw new Error(`cannot compute expert ${frame.expert} of ${frame.layer}`);
      const started = performance.now();
      const n = frame.tokens * frame.hidden;
      const floats = new Float32Array(frame.payload.buffer, 0, n + frame.tokens);
      const out = await session.run({
        hidden: new ort.Tensor("float32", floats.slice(0, n), [1, frame.tokens, frame.hidden]),
        gates: new ort.Tensor("float32", floats.slice(n), [1, frame.tokens, 1])});
      const y = out[session.outputNames[0]].data;
      send(Moex.RESULT, frame.seq, {layer: frame.layer, expert: frame.expert, tokens: frame.tokens,
                                    hidden: frame.hidden, payload: new Uint8Array(y.buffer, y.byteOffset, y.byteLength)});
      status.passes += 1;
      status.lastMs = performance.now() - started;
      show();
    }
  }
}
