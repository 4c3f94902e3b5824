// Choosing the next token, exactly as edgerun/model/sampling.py does: a sampled token depends only on
// the logits, the seed and its position in the sequence, so a browser last stage draws the same tokens
// as a native one.

const MASK = (1n << 64n) - 1n;

// The draw in [0, 1) for the token at `position`: one splitmix64 step, its top 53 bits.
export function uniform(seed, position) {
  let state = (BigInt(seed) & MASK) ^ ((BigInt(position) * 0xD1B54A32D192ED03n) & MASK);
  state = (state + 0x9E3779B97F4A7C15n) & MASK;
  let z = ((state ^ (state >> 30n)) * 0xBF58476D1CE4E5B9n) & MASK;
  z = ((z ^ (z >> 27n)) * 0x94D049BB133111EBn) & MASK;
  return Number((z ^ (z >> 31n)) >> 11n) * 2 ** -53;
}

function argmax(logits) {
  let best = 0;
  for (let i = 1; i < logits.length; i++) if (logits[i] > logits[best]) best = i;
  return best;
}

// First index whose running sum is >= target (right: > target), as numpy's searchsorted.
function search(cdf, target, right) {
  for (let i = 0; i < cdf.length; i++) if (right ? cdf[i] > target : cdf[i] >= target) return i;
  return cdf.length;
}

// logits: the vocabulary's logits for the token at `position`; sampling: {temperature, top_k, top_p, min_p, seed}.
export function sample(logits, sampling, position) {
  const temperature = sampling.temperature || 0;
  if (temperature === 0) return argmax(logits);
  const z = Float64Array.from(logits, (x) => x / temperature);
  // Most to least likely, ties by index, as a stable sort does.
  let candidates = Array.from(z.keys()).sort((a, b) => z[b] - z[a] || a - b);
  const topK = sampling.top_k || 0, topP = sampling.top_p ?? 1, minP = sampling.min_p || 0;
  if (topK > 0 && topK < z.length) candidates = candidates.slice(0, topK);
  // A temperature so small that the logits overflow: the greedy draw, as sampling.py's.
  if (!Number.isFinite(z[candidates[0]])) return argmax(logits);
  // Each candidate's probability over the first's; with min-p, the prefix at least min-p times as likely.
  let weights = candidates.map((i) => Math.exp(z[i] - z[candidates[0]]));
  if (minP > 0) weights = weights.slice(0, weights.filter((w) => w >= minP).length);
  let cdf = [], sum = 0;
  for (const w of weights) cdf.push(sum += w);
  if (topP < 1) cdf = cdf.slice(0, search(cdf, topP * cdf[cdf.length - 1], false) + 1);
  const index = search(cdf, uniform(sampling.seed || 0, position) * cdf[cdf.length - 1], true);
  return candidates[Math.min(index, cdf.length - 1)];
}
