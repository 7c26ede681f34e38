"""One Flax NNX decoder for Llama, Qwen2/2.5, Qwen3 and Mistral.

Axes: B rows, T tokens, S cache slots, D model width, F MLP width, V vocab,
L layers, N query heads, K kv heads, H head dim.

Layer parameters are stacked on a leading L axis and the uncached forward
(training, log-probs) runs the layers under one `lax.scan`, so its compile
time does not grow with depth. The cached forward (prefill, decoding) runs
them unrolled, each layer on its own cache buffers (see cache.KVCache).
Weights keep Hugging Face's [out, in] layouts (e.g. wq [L, N, H, D]) so
loading is a plain copy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpojax.models import cache as cache_lib
from grpojax.models import cpu_kernels
from grpojax.models import sharding as sharding_lib
from grpojax.models.config import ModelConfig, get_preset

Params = dict[str, jax.Array]


def param_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
  """{name: (shape, logical axes)} of every parameter; the single source of truth."""
  L, D, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
  N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  specs = {
      "embed": ((V, D), ("vocab", "embed")),
      "final_norm": ((D,), ("embed",)),
      "attn_norm": ((L, D), ("layers", "embed")),
      "wq": ((L, N, H, D), ("layers", "heads", "head_dim", "embed")),
      "wk": ((L, K, H, D), ("layers", "kv_heads", "head_dim", "embed")),
      "wv": ((L, K, H, D), ("layers", "kv_heads", "head_dim", "embed")),
      "wo": ((L, D, N, H), ("layers", "embed", "heads", "head_dim")),
      "mlp_norm": ((L, D), ("layers", "embed")),
      "w_gate": ((L, F, D), ("layers", "mlp", "embed")),
      "w_up": ((L, F, D), ("layers", "mlp", "embed")),
      "w_down": ((L, D, F), ("layers", "embed", "mlp")),
  }
  if not cfg.tie_embeddings:
    specs["lm_head"] = ((V, D), ("vocab", "embed"))
  if cfg.qkv_bias:
    specs["bq"] = ((L, N, H), ("layers", "heads", "head_dim"))
    specs["bk"] = ((L, K, H), ("layers", "kv_heads", "head_dim"))
    specs["bv"] = ((L, K, H), ("layers", "kv_heads", "head_dim"))
  if cfg.o_bias:
    specs["bo"] = ((L, D), ("layers", "embed"))
  if cfg.mlp_bias:
    specs["b_gate"] = ((L, F), ("layers", "mlp"))
    specs["b_up"] = ((L, F), ("layers", "mlp"))
    specs["b_down"] = ((L, D), ("layers", "embed"))
  if cfg.qk_norm:
    specs["q_norm"] = ((L, H), ("layers", "head_dim"))
    specs["k_norm"] = ((L, H), ("layers", "head_dim"))
  return specs


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
  """Random initial parameters as HF does it: N(0, 0.02) matrices, unit norms, zero biases."""
  specs = sorted(param_specs(cfg).items())
  matrices = [(n, shape) for n, (shape, _) in specs if not n.endswith("norm") and n[0] != "b"]
  # One draw sliced into all matrices: one RNG kernel to compile instead of one per matrix.
  sizes = [int(np.prod(shape)) for _, shape in matrices]
  flat = 0.02 * jax.random.normal(key, (sum(sizes),), cfg.param_dtype)
  out = {}
  for (name, shape), chunk in zip(matrices, jnp.split(flat, np.cumsum(sizes)[:-1])):
    out[name] = chunk.reshape(shape)
  for name, (shape, _) in specs:
    if name.endswith("norm"):
      out[name] = jnp.ones(shape, cfg.param_dtype)
    elif name not in out:
      out[name] = jnp.zeros(shape, cfg.param_dtype)
  return out


# ---------------------------------------------------------------- pure pieces


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
  """Inverse frequencies [H/2] float32, with the config's scaling rule applied."""
  exponents = np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim
  inv_freq = 1.0 / cfg.rope_theta**exponents
  if cfg.rope_type == "linear":
    inv_freq = inv_freq / cfg.rope_factor
  elif cfg.rope_type == "llama3":
    # Long wavelengths (beyond the original context / low_freq_factor) are slowed
    # down by `factor`, short ones kept, and the band between interpolated.
    wavelen = 2 * np.pi / inv_freq
    ctx = cfg.rope_original_max_position
    lo, hi = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    smooth = np.clip((ctx / wavelen - lo) / (hi - lo), 0.0, 1.0)
    inv_freq = (1 - smooth) * inv_freq / cfg.rope_factor + smooth * inv_freq
  return inv_freq.astype(np.float32)


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(cos, sin) [B, T, 1, H/2] float32 for positions [B, T], shared by all layers."""
  angles = positions[..., None].astype(jnp.float32) * rope_frequencies(cfg)  # [B, T, H/2]
  return jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
  """Rotate x [B, T, n, H] by rope_tables' (cos, sin); HF's half-split convention, in float32."""
  cos, sin = rope
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """RMSNorm over the last axis; the statistics in float32 whatever x's dtype."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return y.astype(x.dtype) * scale.astype(x.dtype)


def _linear(x: jax.Array, w) -> jax.Array:
  """x [..., I] times a weight stored [O, I] (or [O, *, *] flattening to it) -> [..., O].

  w may instead be packed for the native CPU kernel (see decode_params): one
  custom call when lowered for the CPU, the same product from the panels elsewhere.
  """
  if not isinstance(w, cpu_kernels.PackedWeight):
    return jnp.einsum("...i,oi->...o", x, w.astype(x.dtype).reshape(-1, x.shape[-1]))
  y = jax.lax.platform_dependent(x.reshape(-1, x.shape[-1]), w, cpu=cpu_kernels.dense,
                                 default=cpu_kernels.dense_xla)
  return y.reshape(*x.shape[:-1], w.features)


def _layer(cfg: ModelConfig, p: Params, x, rope, attend):
  """One decoder block on x [B, T, D] with this layer's parameters p.

  attend(q [B, T, N, H], k, v [B, T, K, H]) -> (attention output [B, T, N, H],
  state): how the block attends (full causal, or through a cache it updates);
  the state (e.g. the updated cache) is returned with the block's output.
  """
  attn, state = attend(*_layer_qkv(cfg, p, x, rope))
  return _layer_finish(cfg, p, x, attn), state


def _layer_qkv(cfg: ModelConfig, p: Params, x, rope):
  """The block's first half: q [B, T, N, H], k, v [B, T, K, H] from x [B, T, D]."""
  dt = x.dtype
  w = lambda name: p[name].astype(dt)  # noqa: E731
  B, T, _ = x.shape
  N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  # Projections as 2-D matmuls on flattened [out, in] weights: with the head
  # axes kept separate, XLA:CPU copies a transposed weight on every call.
  proj = lambda h, name, *heads: _linear(h, p[name]).reshape(B, T, *heads)  # noqa: E731

  h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
  if "wqkv" in p:  # fused (decode_params)
    q, k, v = jnp.split(proj(h, "wqkv", N + 2 * K, H), [N, N + K], axis=2)
  else:
    q, k, v = proj(h, "wq", N, H), proj(h, "wk", K, H), proj(h, "wv", K, H)
  if cfg.qkv_bias:
    q, k, v = q + w("bq"), k + w("bk"), v + w("bv")
  if cfg.qk_norm:
    q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
  return apply_rope(q, rope), apply_rope(k, rope), v


@jax.custom_vjp
def _wide_matmul(x, w):
  """x [B, T, D] @ w [F, D].T -> [B, T, F] for F > D, with a backward XLA:CPU runs faster.

  A custom VJP: reverse mode only (jax.jvp through the MLP is not defined).
  """
  return jnp.einsum("btd,fd->btf", x, w)


def _wide_matmul_fwd(x, w):
  return _wide_matmul(x, w), (x, w)


def _wide_matmul_bwd(res, g):
  x, w = res
  # dw = g^T x written as (x^T g)^T: XLA:CPU then transposes the narrow x [BT, D]
  # and the [D, F] result, not the wide gradient g [BT, F] (a slow strided copy).
  dw = jnp.einsum("btd,btf->df", x, g).T
  return jnp.einsum("btf,fd->btd", g, w), dw


_wide_matmul.defvjp(_wide_matmul_fwd, _wide_matmul_bwd)


def _layer_finish(cfg: ModelConfig, p: Params, x, attn):
  """The block's second half: output projection, MLP and both residuals; x [B, T, D]."""
  dt = x.dtype
  w = lambda name: p[name].astype(dt)  # noqa: E731
  B, T, _ = x.shape
  out = _linear(attn.reshape(B, T, -1), p["wo"])
  if cfg.o_bias:
    out = out + w("bo")
  x = x + out

  h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
  if "w_gate_up" in p:  # fused (decode_params)
    gate, up = jnp.split(_linear(h, p["w_gate_up"]), 2, axis=-1)
  else:
    gate = _wide_matmul(h, w("w_gate"))
    up = _wide_matmul(h, w("w_up"))
  if cfg.mlp_bias:
    gate, up = gate + w("b_gate"), up + w("b_up")
  out = _linear(jax.nn.silu(gate) * up, p["w_down"])
  if cfg.mlp_bias:
    out = out + w("b_down")
  return x + out


def decode_params(cfg: ModelConfig, params: Params) -> dict:
  """params as the cached (unrolled) forward reads them fastest; build once per decode loop.

  Returns the global weights plus "layers": one dict per layer, with the q/k/v
  projections fused into "wqkv" [(N + 2K) * H, D] and gate/up into
  "w_gate_up" [2F, D] (one wider matmul each, instead of three and two small
  ones). Split outside the loop: slicing stacked weights inside it copies every
  layer's weights on every step, as XLA does not hoist the slices.
  In float32 with the native CPU kernels (cpu_kernels.available()), the four
  dense weights of each layer and the unembedding ("unembedding_packed") are
  cpu_kernels.PackedWeight panels instead, which `_linear` and `unembed` use.
  """
  if "layers" in params:  # already in this form
    return params
  out = dict(params)
  D, dt = cfg.hidden_size, jnp.dtype(cfg.dtype)
  # float32 on a CPU with the native kernels: the dense layers' weights packed for them.
  packed = dt == jnp.float32 and cpu_kernels.available()
  if packed:  # all layers' panels from the stacked weights in one call each
    L = cfg.num_layers
    flat = lambda *names: [params[n].astype(dt).reshape(L, -1, D) for n in names]  # noqa: E731
    fused = dict(wqkv=cpu_kernels.pack_layers(*flat("wq", "wk", "wv")),
                 w_gate_up=cpu_kernels.pack_layers(*flat("w_gate", "w_up")),
                 wo=cpu_kernels.pack_layers(params["wo"].astype(dt).reshape(L, D, -1)),
                 w_down=cpu_kernels.pack_layers(params["w_down"].astype(dt)))
  layers = []
  for i in range(cfg.num_layers):
    p = _layer_params(cfg, params, i)
    if packed:
      for n in ("wq", "wk", "wv", "w_gate", "w_up"):
        p.pop(n)
      p.update({n: fused[n][i] for n in fused})
    else:
      p["wqkv"] = jnp.concatenate([p.pop(n).reshape(-1, D) for n in ("wq", "wk", "wv")])
      p["w_gate_up"] = jnp.concatenate([p.pop("w_gate"), p.pop("w_up")])
    layers.append(p)
  out["layers"] = tuple(layers)
  if packed:
    w = params["embed"] if cfg.tie_embeddings else params["lm_head"]
    out["unembedding_packed"] = cpu_kernels.pack(w.astype(dt))
  return out


def _layer_params(cfg: ModelConfig, params: dict, i: int) -> Params:
  if "layers" in params:
    return params["layers"][i]
  return {n: params[n][i] for n, (_, axes) in param_specs(cfg).items() if axes[0] == "layers"}


def segment_attention(q: jax.Array, segments, scale: float) -> jax.Array:
  """Attention of q [N, T, Nq, H] over keys and values held in several segments.

  segments: (k [R, K, H, S], v [R, K, S, H], visible, g) tuples, one softmax
  over all of them. A segment holds R = N / g rows, each shared by g
  consecutive query rows (a group's prompt is stored once and read by its g
  samples); visible is a bool mask broadcastable to [N, T, S], or None for all.
  Each product is a plain batched matmul over (R, K) of the cache as stored:
  a kv head's g * T * n queries (n = Nq / K) form one [g*T*n, H] block. The
  softmax is taken segment by segment against the global max, and the output
  divided by the total once at the end: no concatenated [.., sum S] scores.
  Scores, softmax and the sum over segments in float32; returns q's dtype.

  On the CPU, decode steps (T = 1) in float32 run all segments through one
  call of `cpu_kernels`'s native kernel instead, when it is available.
  """
  N, T, Nq, H = q.shape
  K = segments[0][0].shape[1]
  m = T * (Nq // K)
  q = (q * scale).astype(q.dtype)
  q = q.reshape(N, T, K, Nq // K, H).transpose(0, 2, 1, 3, 4).reshape(N, K, m, H)
  xla = functools.partial(_segment_attention_xla, segments=segments, T=T)
  if (T == 1 and all(x.dtype == jnp.float32 for s in segments for x in s[:2])
      and cpu_kernels.supports(q.dtype, H) and _rows_nest(segments)
      and cpu_kernels.available()):
    out = jax.lax.platform_dependent(
        q, cpu=functools.partial(_segment_attention_cpu, segments=segments), default=xla)
  else:
    out = xla(q)
  return out.reshape(N, K, T, Nq // K, H).transpose(0, 2, 1, 3, 4).reshape(N, T, Nq, H).astype(q.dtype)


# Masked scores: finite (as jax.nn.dot_product_attention's), so that no backend's
# fused max/exp/sum ever meets -inf - (-inf).
_MASKED = -0.7 * float(np.finfo(np.float32).max)


def _rows_nest(segments) -> bool:
  """Every segment's row count is a multiple of the smallest (the kernel's grouping)."""
  fewest = min(k.shape[0] for k, *_ in segments)
  return all(k.shape[0] % fewest == 0 for k, *_ in segments)


def _segment_attention_cpu(q, segments):
  """segment_attention's T = 1 case through the CPU kernel: q [N, K, m, H] -> same."""
  N = q.shape[0]
  parts = []
  for k, v, visible, _ in segments:
    S = k.shape[-1]
    visible = jnp.ones((N, S), bool) if visible is None else jnp.broadcast_to(visible, (N, 1, S))
    parts.append((k, v, visible.reshape(N, S)))
  return cpu_kernels.attend(q, parts)


def _segment_attention_xla(q, segments, T):
  """segment_attention on q [N, K, m, H] (scaled, m = T * Nq / K): [N, K, m, H] float32."""
  N, K, m, _ = q.shape
  f32 = jnp.float32

  def by_segment(x, g):  # [N, K, m, X] -> [N/g, K, g*m, X]
    return x.reshape(N // g, g, K, m, -1).transpose(0, 2, 1, 3, 4).reshape(N // g, K, g * m, -1)

  def by_row(x, g):  # the inverse
    return x.reshape(N // g, K, g, m, -1).transpose(0, 2, 1, 3, 4).reshape(N, K, m, -1)

  scores, top = [], None
  for k, v, visible, g in segments:
    s = jnp.einsum("rkmh,rkhs->rkms", by_segment(q, g), k, preferred_element_type=f32)
    if visible is not None:
      S = k.shape[-1]
      visible = jnp.broadcast_to(visible, (N, T, S)).reshape(N // g, g, 1, T, 1, S)
      visible = jnp.broadcast_to(visible, (N // g, g, 1, T, m // T, S))
      s = jnp.where(visible.reshape(N // g, 1, g * m, S), s, _MASKED)
    scores.append(s)
    s_max = by_row(jnp.max(s, axis=-1, keepdims=True), g)
    top = s_max if top is None else jnp.maximum(top, s_max)
  # A query always sees at least its own slot (the caller's masks ensure it); were
  # one to see none, the finite mask value would give it finite garbage, never NaN.
  out, total = 0.0, 0.0
  for (k, v, _, g), s in zip(segments, scores):
    p = jnp.exp(s - by_segment(top, g))
    total = total + by_row(jnp.sum(p, axis=-1, keepdims=True), g)
    out = out + by_row(jnp.einsum("rkms,rksh->rkmh", p.astype(v.dtype), v,
                                  preferred_element_type=f32), g)
  return out / total


def unrolled_layers(cfg: ModelConfig, params, x: jax.Array, rope, attend_fn):
  """x [B, T, D] through the layers, unrolled (the cached paths: see KVCache).

  attend_fn(i) gives layer i's attend (see _layer). params: stacked, or as
  decode_params returns them. Returns (x, [each layer's attend state]).
  """
  states = []
  for i in range(cfg.num_layers):
    x, state = _layer(cfg, _layer_params(cfg, params, i), x, rope, attend_fn(i))
    states.append(state)
  return x, states


def default_positions(mask: jax.Array, start: jax.Array | int = 0) -> jax.Array:
  """Positions [B, T] counting only real tokens: left padding does not shift RoPE."""
  return start + jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)


def forward(cfg: ModelConfig, params: Params, tokens: jax.Array | None, positions=None, mask=None,
            cache: cache_lib.KVCache | None = None, *, embeddings: jax.Array | None = None):
  """The decoder as a pure function: (final-normed hidden [B, T, D], updated cache or None).

  tokens: [B, T] int, or None with `embeddings` [B, T, D] given instead (input
  embeddings, e.g. to differentiate with respect to the input).
  mask: [B, T] bool, False for padding (default: all real).
  positions: [B, T] int (default: count of real tokens before each, offset by
  the cache's next_pos). With a cache, the T tokens go to slots index..index+T-1.
  """
  dt = jnp.dtype(cfg.dtype)
  if embeddings is None:
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"tokens must be an int array [B, T], got {tokens.dtype}{list(tokens.shape)}")
    x = jnp.take(params["embed"], tokens, axis=0).astype(dt)
  else:
    x = jnp.asarray(embeddings).astype(dt)
    if x.shape[2:] != (cfg.hidden_size,) or x.ndim != 3:
      raise ValueError(f"embeddings must be [B, T, {cfg.hidden_size}], got {list(x.shape)}")
  B, T = x.shape[:2]
  span = T if cache is None else cache.max_len
  if cfg.sliding_window is not None and span > cfg.sliding_window:
    raise ValueError(f"sequence/cache length {span} exceeds sliding_window={cfg.sliding_window}; "
                     "sliding-window attention is not supported")
  if cache is not None and T > cache.max_len:
    raise ValueError(f"{T} tokens do not fit a cache of {cache.max_len} slots")
  mask = jnp.ones((B, T), bool) if mask is None else jnp.asarray(mask).astype(bool)
  if mask.shape != (B, T):
    raise ValueError(f"mask shape {mask.shape} does not match tokens shape {(B, T)}")
  start = 0 if cache is None else cache.next_pos[:, None]
  positions = default_positions(mask, start) if positions is None else jnp.asarray(positions)
  if positions.shape != (B, T):
    raise ValueError(f"positions shape {positions.shape} does not match tokens shape {(B, T)}")

  if cache is None:
    slots = jnp.arange(T)
    attn_mask = cache_lib.attention_mask(mask, slots, slots)
    index, valid = None, None
  else:
    index = cache.index
    valid = cache_lib.write_valid(cache.valid, mask, index)
    attn_mask = cache_lib.attention_mask(valid, index + jnp.arange(T), jnp.arange(cache.max_len))

  rope = rope_tables(cfg, positions)
  scale = cfg.head_dim**-0.5
  if cache is None:
    def attend(q, k, v):
      # GQA is native (no repeated kv heads); softmax statistics are float32 in either
      # implementation. The mask, not seq-lengths, carries padding: prompts are left-padded.
      return jax.nn.dot_product_attention(q, k, v, mask=attn_mask, scale=scale,
                                          implementation=cfg.attention_impl), None

    x = _scan_layers(cfg, params, lambda x, p: _layer(cfg, p, x, rope, attend)[0], x)
  else:
    def cached(i):
      def attend(q, k, v):
        k, v = cache_lib.write(cache.k[i].astype(dt), cache.v[i].astype(dt), k, v, index)
        return segment_attention(q, [(k, v, attn_mask[:, 0], 1)], scale), (k, v)
      return attend

    x, kv = unrolled_layers(cfg, params, x, rope, cached)
    ks, vs = zip(*kv)
  hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
  if cache is None:
    return hidden, None
  next_pos = jnp.max(jnp.where(mask, positions + 1, cache.next_pos[:, None]), axis=1)
  new_cache = cache_lib.KVCache(k=ks, v=vs, valid=valid, index=index + T,
                                next_pos=next_pos.astype(jnp.int32))
  return hidden, new_cache


def _scan_layers(cfg: ModelConfig, params: Params, body, carry):
  """carry through body(carry, layer params) for each layer, under one lax.scan."""
  if cfg.remat:
    # Per-layer rematerialisation: only each layer's input is kept for backward.
    body = jax.checkpoint(body, prevent_cse=False)
  layer_names = [n for n, (_, axes) in param_specs(cfg).items() if axes[0] == "layers"]
  return jax.lax.scan(lambda c, p: (body(c, p), None), carry,
                      {n: params[n] for n in layer_names})[0]


def forward_shared_prompt(cfg: ModelConfig, params: Params, prompt_tokens: jax.Array,
                          prompt_mask: jax.Array, tokens: jax.Array, mask: jax.Array):
  """The uncached forward of N = B*g rows whose groups of g consecutive rows share a prompt.

  Equals `forward` on each row's concatenated prompt + completion, but each
  prompt is run once, not g times: its keys and values are shared by its
  group's completions (gradients through them sum over the group, as they would
  over g copies). The saving is (g - 1) / g of the prompt tokens' work.

  prompt_tokens, prompt_mask: [B, P], left-padded. tokens, mask: [N, T].
  Returns final-normed hidden states (prompt [B, P, D], completion [N, T, D]).
  """
  B, P = prompt_tokens.shape
  N, T = tokens.shape
  if N % B or mask.shape != (N, T) or prompt_mask.shape != (B, P):
    raise ValueError(f"{N} completion rows [N, T] = {list(tokens.shape)} (mask {list(mask.shape)}) "
                     f"do not form groups of the prompts {list(prompt_tokens.shape)} "
                     f"(mask {list(prompt_mask.shape)})")
  g = N // B
  dt = jnp.dtype(cfg.dtype)
  xp = jnp.take(params["embed"], prompt_tokens, axis=0).astype(dt)
  xc = jnp.take(params["embed"], tokens, axis=0).astype(dt)
  prompt_mask, mask = prompt_mask.astype(bool), mask.astype(bool)
  # Positions and masks exactly as `forward` makes them for the concatenation
  # (kv_valid is each row's full prompt + completion mask).
  kv_valid = jnp.concatenate([jnp.repeat(prompt_mask, g, axis=0), mask], axis=1)
  rope_p = rope_tables(cfg, default_positions(prompt_mask))
  rope_c = rope_tables(cfg, default_positions(kv_valid)[:, P:])
  mask_p = cache_lib.attention_mask(prompt_mask, jnp.arange(P), jnp.arange(P))
  mask_c = cache_lib.attention_mask(kv_valid, P + jnp.arange(T), jnp.arange(P + T))
  attention = lambda q, k, v, m: jax.nn.dot_product_attention(  # noqa: E731
      q, k, v, mask=m, scale=cfg.head_dim**-0.5, implementation=cfg.attention_impl)

  def body(x, p):
    xp, xc = x
    qp, kp, vp = _layer_qkv(cfg, p, xp, rope_p)
    qc, kc, vc = _layer_qkv(cfg, p, xc, rope_c)
    k = jnp.concatenate([jnp.repeat(kp, g, axis=0), kc], axis=1)
    v = jnp.concatenate([jnp.repeat(vp, g, axis=0), vc], axis=1)
    return (_layer_finish(cfg, p, xp, attention(qp, kp, vp, mask_p)),
            _layer_finish(cfg, p, xc, attention(qc, k, v, mask_c)))

  xp, xc = _scan_layers(cfg, params, body, (xp, xc))
  norm = lambda x: rms_norm(x, params["final_norm"], cfg.rms_norm_eps)  # noqa: E731
  return norm(xp), norm(xc)


def unembed(cfg: ModelConfig, params: Params, hidden: jax.Array) -> jax.Array:
  """Logits [..., V] in float32 from hidden [..., D], accumulated in float32."""
  if "unembedding_packed" in params:  # decode_params, float32
    return _linear(hidden, params["unembedding_packed"])
  w = params["embed"] if cfg.tie_embeddings else params["lm_head"]  # [V, D]
  return jnp.einsum("...d,vd->...v", hidden, w.astype(hidden.dtype),
                    preferred_element_type=jnp.float32)


# ---------------------------------------------------------------- the module


class Transformer(nnx.Module):
  """The decoder. `model(tokens)` → logits; `prefill`/`decode` run with a KVCache.

  Each parameter is an nnx.Param with `logical_axes` metadata (see param_specs).
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs | None = None,
               params: Params | None = None):
    """Random init from `rngs`, or wrap given `params` ({name: array}, no copy)."""
    self.config = config
    specs = param_specs(config)
    if params is None:
      if rngs is None:
        raise ValueError("Transformer needs rngs (random init) or params (loaded weights)")
      params = init_params(config, rngs.params())
    missing = sorted(set(specs) - set(params))
    if missing:
      raise ValueError(f"missing parameters: {', '.join(missing)}")
    for name, (shape, axes) in specs.items():
      if tuple(params[name].shape) != shape:
        raise ValueError(f"parameter {name} has shape {tuple(params[name].shape)}, expected {shape}")
      setattr(self, name, nnx.Param(params[name], logical_axes=axes))
    self.source_path: str | None = None  # HF directory it was loaded from, if any

  def param_dict(self) -> Params:
    """{name: array} of the current parameter values."""
    return {name: getattr(self, name)[...] for name in param_specs(self.config)}

  def __call__(self, tokens, positions=None, mask=None) -> jax.Array:
    """Logits [B, T, V] float32 for tokens [B, T] (positions/mask: see `forward`)."""
    return self.logits(self.hidden(tokens, positions, mask))

  def hidden(self, tokens, positions=None, mask=None) -> jax.Array:
    """Final-normed hidden states [B, T, D] in the compute dtype (logits = logits(hidden))."""
    return forward(self.config, self.param_dict(), tokens, positions, mask)[0]

  def logits(self, hidden: jax.Array) -> jax.Array:
    """Float32 logits [..., V] from hidden states [..., D]."""
    return unembed(self.config, self.param_dict(), hidden)

  def unembedding(self) -> jax.Array:
    """The output matrix [D, V] in the compute dtype: logits = hidden @ unembedding()."""
    w = self.embed[...] if self.config.tie_embeddings else self.lm_head[...]
    return w.T.astype(self.config.dtype)

  def prefill(self, tokens, cache: cache_lib.KVCache, positions=None, mask=None, *,
              all_logits: bool = False):
    """Write tokens [B, P] (left-padded; mask [B, P]) into the cache.

    Returns (logits, cache): logits [B, 1, V] of the last position only (the one
    sampling needs; avoids a [B, P, V] tensor), or [B, P, V] with all_logits=True.
    """
    hidden, cache = forward(self.config, self.param_dict(), tokens, positions, mask, cache)
    return self.logits(hidden if all_logits else hidden[:, -1:]), cache

  def decode(self, tokens, cache: cache_lib.KVCache, positions=None):
    """One step: tokens [B, 1] (positions default to cache.next_pos) → (logits [B, 1, V], cache)."""
    hidden, cache = forward(self.config, self.param_dict(), tokens, positions, None, cache)
    return self.logits(hidden), cache


# ---------------------------------------------------------------- building


def param_shardings(config: ModelConfig, mesh: jax.sharding.Mesh, rules=None):
  """{name: NamedSharding} for every parameter under the logical-axis `rules` dict."""
  return sharding_lib.named_shardings(param_specs(config), mesh, rules)


def build_model(config: ModelConfig | str, *, seed: int = 0, mesh=None, rules=None,
                **overrides) -> Transformer:
  """A randomly initialised model from a config or a preset name ("tiny", ...).

  With a mesh, parameters are created directly in their shards (no full copy on one device).
  """
  cfg = get_preset(config, **overrides) if isinstance(config, str) else config.replace(**overrides)
  if mesh is None:
    init = _init_jit
  else:
    init = jax.jit(init_params, static_argnums=0, out_shardings=param_shardings(cfg, mesh, rules))
  return Transformer(cfg, params=init(cfg, jax.random.key(seed)))


_init_jit = jax.jit(init_params, static_argnums=0)


def shard_model(model: Transformer, mesh: jax.sharding.Mesh, rules=None) -> Transformer:
  """The same model with every parameter placed by the logical-axis rules on `mesh`."""
  shardings = param_shardings(model.config, mesh, rules)
  params = {n: jax.device_put(a, shardings[n]) for n, a in model.param_dict().items()}
  out = Transformer(model.config, params=params)
  out.source_path = model.source_path
  return out
