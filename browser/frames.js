// Pipeline frames (edgerun/net/wire.py) and the HMAC-SHA256 that seals them, in plain JavaScript:
// WebCrypto exists only in secure contexts, and a node page on a LAN address
// (http://10.0.0.1:7000/node) is not one. No browser APIs here, so Node.js can test it.

const PP_MAGIC = [0x45, 0x50]; // "EP"
const PP_VERSION = 1;
const HEADER = 16; // magic 2, version 1, type 1, request 4, JSON length 4, payload length 4
const MAC_SIZE = 16;
export const Msg = {INIT: 1, CONNECT: 2, DOWNLOAD_LAYERS: 3, LAYER_DOWNLOAD: 4, PREPARE_MODEL: 5, PREPARE_DONE: 6,
             COMMIT_MODEL: 7, COMMIT_DONE: 8, COMPUTATION: 9, COMPUTATION_RESULT: 10, INVALIDATE_CACHE: 11,
             RELEASE_SESSION: 12, ERROR: 13, PING: 14, PONG: 15, KV_FETCH: 16, KV_DATA: 17, KV_LOAD: 18,
             KV_LOADED: 19};
const DTYPES = {float32: Float32Array, int64: BigInt64Array, int32: Int32Array};

// --- SHA-256 (FIPS 180-4) and HMAC (RFC 2104)
const K = new Int32Array(new Uint32Array([
  0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
  0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
  0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
  0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
  0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
  0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
  0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
  0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2]).buffer);

// Plain locals, no arrays built per round: V8 keeps them in registers (with a destructuring swap per round, this
// hashed 12 MB/s, and a tab checking a 70 MB stage file spent 6 s on it).
export function sha256(data) {
  const bytes = data instanceof Uint8Array ? data : new Uint8Array(data);
  const bitLength = bytes.length * 8;
  const padded = new Uint8Array(Math.ceil((bytes.length + 9) / 64) * 64);
  padded.set(bytes);
  padded[bytes.length] = 0x80;
  const view = new DataView(padded.buffer);
  view.setUint32(padded.length - 8, Math.floor(bitLength / 2 ** 32));
  view.setUint32(padded.length - 4, bitLength >>> 0);
  let h0 = 0x6a09e667, h1 = 0xbb67ae85, h2 = 0x3c6ef372, h3 = 0xa54ff53a;
  let h4 = 0x510e527f, h5 = 0x9b05688c, h6 = 0x1f83d9ab, h7 = 0x5be0cd19;
  const w = new Int32Array(64);
  for (let block = 0; block < padded.length; block += 64) {
    for (let i = 0; i < 16; i++) w[i] = view.getInt32(block + 4 * i);
    for (let i = 16; i < 64; i++) {
      const x = w[i - 15], y = w[i - 2];
      const s0 = ((x >>> 7) | (x << 25)) ^ ((x >>> 18) | (x << 14)) ^ (x >>> 3);
      const s1 = ((y >>> 17) | (y << 15)) ^ ((y >>> 19) | (y << 13)) ^ (y >>> 10);
      w[i] = (w[i - 16] + s0 + w[i - 7] + s1) | 0;
    }
    let a = h0, b = h1, c = h2, d = h3, e = h4, f = h5, g = h6, hh = h7;
    for (let i = 0; i < 64; i++) {
      const s1 = ((e >>> 6) | (e << 26)) ^ ((e >>> 11) | (e << 21)) ^ ((e >>> 25) | (e << 7));
      const t1 = (hh + s1 + ((e & f) ^ (~e & g)) + K[i] + w[i]) | 0;
      const s0 = ((a >>> 2) | (a << 30)) ^ ((a >>> 13) | (a << 19)) ^ ((a >>> 22) | (a << 10));
      const t2 = (s0 + ((a & b) ^ (a & c) ^ (b & c))) | 0;
      hh = g;
      g = f;
      f = e;
      e = (d + t1) | 0;
      d = c;
      c = b;
      b = a;
      a = (t1 + t2) | 0;
    }
    h0 = (h0 + a) | 0;
    h1 = (h1 + b) | 0;
    h2 = (h2 + c) | 0;
    h3 = (h3 + d) | 0;
    h4 = (h4 + e) | 0;
    h5 = (h5 + f) | 0;
    h6 = (h6 + g) | 0;
    h7 = (h7 + hh) | 0;
  }
  const out = new Uint8Array(32);
  const outView = new DataView(out.buffer);
  [h0, h1, h2, h3, h4, h5, h6, h7].forEach((x, i) => outView.setInt32(4 * i, x));
  return out;
}

// A file's SHA-256 in hex: WebCrypto's where the page is a secure context (localhost, https; and Node.js), at
// native speed on a stage of tens of MB; elsewhere (a LAN address over http) the one above.
export async function sha256Hex(bytes) {
  const digest = globalThis.crypto?.subtle ? new Uint8Array(await crypto.subtle.digest("SHA-256", bytes))
    : sha256(bytes);
  return hex(digest);
}

function concat(...parts) {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let offset = 0;
  for (const p of parts) { out.set(p, offset); offset += p.length; }
  return out;
}

export function hmacSha256(key, data) {
  let k = key.length > 64 ? sha256(key) : key;
  k = concat(k, new Uint8Array(64 - k.length));
  const inner = k.map((x) => x ^ 0x36), outer = k.map((x) => x ^ 0x5c);
  return sha256(concat(outer, sha256(concat(inner, data))));
}

export function clusterKey(secret) { // as derive_key in edgerun/net/wire.py
  return sha256(concat(new TextEncoder().encode("edgerun cluster key\0"), new TextEncoder().encode(secret)));
}

export const hex = (bytes) => Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");

// --- frames
export function packFrame(key, type, request, message, tensors = {}) {
  const described = {}, chunks = [];
  let offset = 0;
  for (const [name, {dtype, shape, data}] of Object.entries(tensors)) {
    const raw = new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
    described[name] = {dtype, shape, offset, bytes: raw.length};
    chunks.push(raw);
    offset += raw.length;
  }
  const text = new TextEncoder().encode(JSON.stringify(Object.keys(described).length ?
                                                       {...message, tensors: described} : message));
  const payload = concat(...chunks);
  const header = new Uint8Array(HEADER);
  const view = new DataView(header.buffer);
  header.set(PP_MAGIC, 0);
  view.setUint8(2, PP_VERSION);
  view.setUint8(3, type);
  view.setUint32(4, request, true);
  view.setUint32(8, text.length, true);
  view.setUint32(12, payload.length, true);
  const body = concat(header, text, payload);
  return concat(body, hmacSha256(key, body).slice(0, MAC_SIZE));
}

export function openFrame(key, buffer) {
  const bytes = new Uint8Array(buffer);
  if (bytes.length < HEADER + MAC_SIZE) throw new Error("frame too short");
  const body = bytes.subarray(0, bytes.length - MAC_SIZE);
  const mac = hmacSha256(key, body).slice(0, MAC_SIZE);
  if (hex(mac) !== hex(bytes.subarray(bytes.length - MAC_SIZE))) throw new Error("bad MAC (wrong cluster key?)");
  const view = new DataView(body.buffer, body.byteOffset, body.byteLength);
  if (body[0] !== PP_MAGIC[0] || body[1] !== PP_MAGIC[1]) throw new Error("bad magic");
  if (view.getUint8(2) !== PP_VERSION) throw new Error(`protocol version ${view.getUint8(2)}`);
  const type = view.getUint8(3), request = view.getUint32(4, true);
  const textLength = view.getUint32(8, true), payloadLength = view.getUint32(12, true);
  if (HEADER + textLength + payloadLength !== body.length) throw new Error("lengths do not match the frame");
  const message = JSON.parse(new TextDecoder().decode(body.subarray(HEADER, HEADER + textLength)));
  const payload = body.subarray(HEADER + textLength);
  const tensors = {};
  for (const [name, d] of Object.entries(message.tensors || {})) {
    const Type = DTYPES[d.dtype];
    if (!Type || d.offset + d.bytes > payload.length) throw new Error(`tensor ${name} does not fit`);
    const copy = payload.slice(d.offset, d.offset + d.bytes); // aligned for the typed array
    tensors[name] = {dtype: d.dtype, shape: d.shape, data: new Type(copy.buffer)};
  }
  return {type, request, message, tensors};
}

