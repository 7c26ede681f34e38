"""One Flax NNX decoder for Llama, Qwen2/2.5, Qwen3, Mistral and Gemma 2/3.

Axes: B rows, T tokens, S cache slots, D model width, F MLP width, V vocab,
L layers, N query heads, K kv heads, H head dim.

Layer parameters are stacked on a leading L axis. The forwards without a
cache (training, log-probs) and `prefill` run the layers under one
`lax.scan`, so their compile time does not grow with depth. `decode_step`
runs them unrolled, each layer on its own cache buffers (see cache.KVCache):
a layer scan there would copy each layer's slice of the cache and weights on
every step. The sampler's loop holds one decode step, so each layer compiles
once. What differs between model families is in arch.py; the ops with
platform-tuned variants (dense, decode attention) go through grpojax.ops.
Weights keep Hugging Face's [out, in] layouts (e.g. wq [L, N, H, D]) so
loading is a plain copy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpojax import ops
from grpojax.core.logprobs import soft_cap
from grpojax.models import cache as cache_lib
from grpojax.models import lora as lora_lib
from grpojax.models import sharding as sharding_lib
from grpojax.models.arch import rms_norm  # noqa: F401  (re-exported)
from grpojax.models.config import ModelConfig, get_preset
from grpojax.parallel import mesh as mesh_lib

Params = dict[str, jax.Array]


def param_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
  """{name: (shape, logical axes)} of every parameter; the single source of truth is the
  family's description, cfg.architecture.param_specs (arch.py)."""
  return cfg.architecture.param_specs(cfg)


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
    if name.endswith("norm"):  # 1 for Llama's x * w, 0 for Gemma's x * (1 + w)
      out[name] = jnp.full(shape, cfg.architecture.norm_init, cfg.param_dtype)
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


def _ropes(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, ...]:
  """rope_tables for positions [B, T]: (cos, sin), then the sliding layers' (cos, sin)
  when they have their own base (cfg.rope_local_theta: unscaled, as Gemma 3's)."""
  tables = rope_tables(cfg, positions)
  if cfg.rope_local_theta is None:
    return tables
  local = cfg.replace(rope_theta=cfg.rope_local_theta, rope_type="default", rope_factor=1.0)
  return tables + rope_tables(local, positions)


def _layer_rope(cfg: ModelConfig, ropes: tuple, layer) -> tuple[jax.Array, jax.Array]:
  """Layer `layer`'s (cos, sin) among _ropes' tables; layer: a Python int (unrolled
  decoding) or a traced int32 (the layer scan), None where no layer differs."""
  if len(ropes) == 2:
    return ropes
  local = tuple(w is not None for w in cfg.layer_windows)
  if isinstance(layer, int):
    return ropes[2:] if local[layer] else ropes[:2]
  pick = jnp.asarray(local)[layer]
  return tuple(jnp.where(pick, b, a) for a, b in zip(ropes[:2], ropes[2:]))


# A global layer's window in the per-layer window array: past every sequence.
NO_WINDOW = 1 << 30


def _window(cfg: ModelConfig, layer):
  """Layer `layer`'s sliding window: None when no layer has one (no mask work at all);
  else an int, or for a traced layer index an int32 scalar (NO_WINDOW for global layers)."""
  windows = cfg.layer_windows
  if all(w is None for w in windows):
    return None
  if isinstance(layer, int):
    return windows[layer]
  return jnp.asarray([NO_WINDOW if w is None else w for w in windows], jnp.int32)[layer]


def _per_layer(cfg: ModelConfig) -> bool:
  """Whether layers differ in their attention (window or RoPE base): the layer scan then
  hands each layer its index, p["layer"]."""
  return cfg.sliding_window is not None or cfg.rope_local_theta is not None


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
  """Rotate x [B, T, n, H] by rope_tables' (cos, sin); HF's half-split convention, in float32."""
  cos, sin = rope
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def embed(cfg: ModelConfig, params: Params, tokens: jax.Array) -> jax.Array:
  """Input embeddings [B, T, D] in the compute dtype for tokens [B, T] (the architecture's)."""
  return cfg.architecture.embed(cfg, params, tokens)


def unembedding(cfg: ModelConfig, params: Params) -> jax.Array:
  """The output matrix [D, V] in the compute dtype: logits = hidden @ unembedding(cfg, params)."""
  _needs_lm_head(cfg)
  return cfg.architecture.unembedding(cfg, params).T.astype(cfg.dtype)


def _needs_lm_head(cfg: ModelConfig) -> None:
  if cfg.head != "lm":
    raise ValueError(f"this model's head is {cfg.head!r} (a reward model or critic): it has no "
                     "language-model head to give log-probs or sample from")


def score(cfg: ModelConfig, params: Params, hidden: jax.Array) -> jax.Array:
  """The score head at every position: [..., num_labels] float32 from hidden [..., D]
  (a critic's values; a reward model pools them, `sequence_scores`)."""
  if cfg.head != "score":
    raise ValueError(f"this model's head is {cfg.head!r}: it has no score head")
  return jnp.einsum("...d,ld->...l", hidden, params["score"].astype(hidden.dtype),
                    preferred_element_type=jnp.float32)


def with_score_head(cfg: ModelConfig, params: Params, key: jax.Array, *, num_labels: int = 1
                    ) -> tuple[ModelConfig, Params]:
  """(config, parameters) of a score model on the same decoder body: a critic (or a
  reward model to fit) started from a policy, as TRL and verl start PPO's value model
  (HF's *ForSequenceClassification.from_pretrained(policy, num_labels=1)). The
  language-model head is dropped; the score head is drawn N(0, 0.02), as HF
  initialises it. A score model's own head is kept where num_labels agree."""
  if cfg.head == "score" and cfg.num_labels == num_labels:
    return cfg, dict(params)
  out = cfg.replace(head="score", num_labels=num_labels)
  body = {n: params[n] for n in param_specs(out) if n != "score"}
  dtype = params["embed"].dtype
  body["score"] = 0.02 * jax.random.normal(key, (num_labels, cfg.hidden_size), dtype)
  return out, body


def last_token_index(tokens: jax.Array, pad_token_id: int | None) -> jax.Array:
  """[B] int: the position a sequence classifier reads, as HF's *ForSequenceClassification
  picks it: the rightmost token that is not `pad_token_id` (left or right padding alike;
  0 for a row of pads only), or the last position when the model has no pad id."""
  B, T = tokens.shape
  if pad_token_id is None:
    return jnp.full((B,), T - 1, jnp.int32)
  real = (tokens != pad_token_id).astype(jnp.int32)
  return jnp.argmax(jnp.arange(T, dtype=jnp.int32) * real, axis=-1)


def sequence_scores(cfg: ModelConfig, params: Params, tokens: jax.Array, mask=None, positions=None,
                    *, index: jax.Array | None = None) -> jax.Array:
  """A reward model's scores [B, num_labels] float32 of tokens [B, T]: the score head at
  `index` [B] (default: `last_token_index` with the config's pad id, as HF reads it;
  with no pad id HF takes the last position and refuses batches of several rows, which
  this does too). mask, positions: see `forward`."""
  if index is None:
    if cfg.pad_token_id is None and tokens.shape[0] != 1:
      raise ValueError("a score model without pad_token_id reads the last position: give one "
                       "row at a time, or `index` (HF refuses batches > 1 here too)")
    index = last_token_index(tokens, cfg.pad_token_id)
  hidden = forward(cfg, params, tokens, positions, mask)
  picked = jnp.take_along_axis(hidden, index[:, None, None].astype(jnp.int32), axis=1)[:, 0]
  return score(cfg, params, picked)


def unembed(cfg: ModelConfig, params: Params, hidden: jax.Array) -> jax.Array:
  """Logits [..., V] in float32 from hidden [..., D], accumulated in float32."""
  w = params.get("unembedding")  # decode_params': cast once, not on every step
  if w is None:
    _needs_lm_head(cfg)
    w = cfg.architecture.unembedding(cfg, params)  # [V, D]
  elif ops.packs_weights(cfg.kernels, cfg.dtype):  # packed for the native dense kernel
    return soft_cap(ops.linear(hidden, w, cfg.kernels), cfg.final_logit_softcap)
  return soft_cap(jnp.einsum("...d,vd->...v", hidden, w.astype(hidden.dtype),
                             preferred_element_type=jnp.float32), cfg.final_logit_softcap)


def _norm(cfg: ModelConfig, x: jax.Array, scale: jax.Array) -> jax.Array:
  return cfg.architecture.norm(cfg, x, scale)


def _dense(cfg: ModelConfig, p: Params, name: str, h: jax.Array, *, wide: bool = False):
  """h [..., in] through the projection p[name] [out, in] -> [..., out], plus its LoRA
  adapter's term where p holds one (lora.py). A quantised weight is dequantised by ops."""
  w = p[name]
  if wide and not isinstance(w, ops.quant.QuantizedWeight):
    w = w.astype(h.dtype)  # cpu.wide_linear's backward is for a weight in x's dtype
  y = (ops.wide_linear if wide else ops.linear)(h, w, cfg.kernels)
  if name + lora_lib.SUFFIX_A in p:
    y = y + lora_lib.delta(h, p[name + lora_lib.SUFFIX_A], p[name + lora_lib.SUFFIX_B],
                           cfg.lora_scale)
  return y


def _layer_qkv(cfg: ModelConfig, p: Params, x, ropes, layer=None):
  """The block's first half: q [B, T, N, H], k, v [B, T, K, H] from x [B, T, D].
  ropes: _ropes' tables; layer: the layer's index (see _layer_rope)."""
  dt = x.dtype
  w = lambda name: p[name].astype(dt)  # noqa: E731
  B, T, _ = x.shape
  N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  # Projections as 2-D matmuls on flattened [out, in] weights: with the head
  # axes kept separate, XLA:CPU copies a transposed weight on every call.
  proj = lambda h, name, *heads: _dense(cfg, p, name, h).reshape(B, T, *heads)  # noqa: E731

  h = _norm(cfg, x, p["attn_norm"])
  if "wqkv" in p:  # fused (decode_params)
    q, k, v = jnp.split(proj(h, "wqkv", N + 2 * K, H), [N, N + K], axis=2)
  else:
    q, k, v = proj(h, "wq", N, H), proj(h, "wk", K, H), proj(h, "wv", K, H)
  if cfg.qkv_bias:
    q, k, v = q + w("bq"), k + w("bk"), v + w("bv")
  if cfg.qk_norm:
    q = _norm(cfg, q, p["q_norm"])
    k = _norm(cfg, k, p["k_norm"])
  rope = _layer_rope(cfg, ropes, layer)
  return apply_rope(q, rope), apply_rope(k, rope), v


def _layer_finish(cfg: ModelConfig, p: Params, x, attn):
  """The block's second half: output projection, MLP and both residuals; x [B, T, D]."""
  dt = x.dtype
  w = lambda name: p[name].astype(dt)  # noqa: E731
  B, T, _ = x.shape
  out = _dense(cfg, p, "wo", attn.reshape(B, T, -1))
  if cfg.o_bias:
    out = out + w("bo")
  x = x + cfg.architecture.attention_out(cfg, p, out)

  h = _norm(cfg, x, p["mlp_norm"])
  if "w_gate_up" in p:  # fused (decode_params)
    gate, up = jnp.split(ops.linear(h, p["w_gate_up"], cfg.kernels), 2, axis=-1)
  else:
    gate = _dense(cfg, p, "w_gate", h, wide=True)
    up = _dense(cfg, p, "w_up", h, wide=True)
  if cfg.mlp_bias:
    gate, up = gate + w("b_gate"), up + w("b_up")
  out = _dense(cfg, p, "w_down", cfg.architecture.activation(cfg, gate) * up)
  if cfg.mlp_bias:
    out = out + w("b_down")
  return x + cfg.architecture.mlp_out(cfg, p, out)


def decode_params(cfg: ModelConfig, params: Params) -> dict:
  """params as `decode_step` reads them fastest; build once per decode loop, outside it.

  Returns the global weights plus "layers": one dict per layer, with the q/k/v
  projections fused into "wqkv" [(N + 2K) * H, D] and gate/up into
  "w_gate_up" [2F, D] (one wider matmul each, instead of three and two small
  ones). Split outside the loop: slicing stacked weights inside it copies every
  layer's weights on every step, as XLA does not hoist the slices.
  On the cpu backend in float32 (ops.packs_weights), the four dense weights of
  each layer and the unembedding ("unembedding", [V, D] in the compute dtype
  otherwise) are ops.cpu.PackedWeight panels instead, for the native dense kernel:
  the config says which (`unembed` asks ops.packs_weights, never the dict).
  LoRA adapters (models/lora.py) are merged into their weights first. A
  quantised base is neither fused nor merged: per-layer slices, adapters apart.
  """
  if "layers" in params:  # already in this form
    return params
  if any(isinstance(w, ops.quant.QuantizedWeight) for w in params.values()):
    # A quantised base (QLoRA) stays quantised and its adapters stay apart: a fused
    # or merged copy would hold the weights in the compute dtype, the memory the
    # quantisation saves. Each matmul dequantises its weight.
    out = dict(params)
    out["layers"] = tuple(_layer_params(cfg, params, i) for i in range(cfg.num_layers))
    for n in _layer_names(cfg, params):
      out.pop(n)
    out["unembedding"] = cfg.architecture.unembedding(cfg, params).astype(cfg.dtype)
    return out
  if lora_lib.adapter_names(params):
    # Merged once here: the fused weights below are a new copy anyway, so the
    # adapters cost the decode loop nothing per step.
    params = lora_lib.merge(params, cfg.lora_scale)
  out = dict(params)
  D, dt = cfg.hidden_size, jnp.dtype(cfg.dtype)
  packed = ops.packs_weights(cfg.kernels, dt)
  if packed:  # all layers' panels from the stacked weights in one call each
    L = cfg.num_layers
    flat = lambda *names: [params[n].astype(dt).reshape(L, -1, D) for n in names]  # noqa: E731
    fused = dict(wqkv=ops.cpu.pack_layers(*flat("wq", "wk", "wv")),
                 w_gate_up=ops.cpu.pack_layers(*flat("w_gate", "w_up")),
                 wo=ops.cpu.pack_layers(params["wo"].astype(dt).reshape(L, D, -1)),
                 w_down=ops.cpu.pack_layers(params["w_down"].astype(dt)))
  layers = []
  for i in range(cfg.num_layers):
    p = _layer_params(cfg, params, i)
    if packed:
      for n in ("wq", "wk", "wv", "w_gate", "w_up"):
        p.pop(n)
      p.update({n: fused[n][i] for n in fused})
    else:  # the matmul weights in the compute dtype, as each step would cast them
      p["wqkv"] = jnp.concatenate([p.pop(n).reshape(-1, D) for n in ("wq", "wk", "wv")]).astype(dt)
      p["w_gate_up"] = jnp.concatenate([p.pop("w_gate"), p.pop("w_up")]).astype(dt)
      p["wo"], p["w_down"] = p["wo"].astype(dt), p["w_down"].astype(dt)
    layers.append(p)
  out["layers"] = tuple(layers)
  unembedding = cfg.architecture.unembedding(cfg, params).astype(dt)
  out["unembedding"] = ops.cpu.pack(unembedding) if packed else unembedding
  return out


def _layer_params(cfg: ModelConfig, params: dict, i: int) -> Params:
  if "layers" in params:
    return params["layers"][i]
  return {n: jax.tree.map(lambda x: x[i], params[n]) for n in _layer_names(cfg, params)}


def _layer_names(cfg: ModelConfig, params: Params) -> list[str]:
  """The parameters stacked over layers: the model's, and LoRA adapters where params has them."""
  names = [n for n, (_, axes) in param_specs(cfg).items() if axes[0] == "layers"]
  return names + lora_lib.adapter_names(params)


def default_positions(mask: jax.Array, start: jax.Array | int = 0) -> jax.Array:
  """Positions [B, T] counting only real tokens: left padding does not shift RoPE."""
  return start + jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)


def _attention(cfg: ModelConfig, q, k, v, kv_valid, layer=None):
  """Causal attention of q [B, T, Nq, H] over k, v [B, S, K, H], the queries being
  the last T of the S positions (T < S: completions over their shared prompt),
  with `cache.attention_mask`'s padding: kv_valid [B, S].

  Over more than cfg.attention_block keys it runs blockwise (ops.attention):
  no [T, S] scores held, forward or backward. Shorter, the scores are
  materialised, which is faster there. GQA is native (no repeated kv heads);
  softmax statistics are float32 either way. The mask, not seq-lengths, carries
  padding: prompts are left-padded.
  Layer `layer`'s sliding window (slots, as HF's masks count them) and the scores'
  soft-capping come from the config; jax.nn.dot_product_attention cannot cap, so a
  capped model's short sequences run ops.xla.dense_attention (cuDNN's included).
  """
  scale, cap, window = cfg.attention_scale, cfg.attn_logit_softcap, _window(cfg, layer)
  T, S = q.shape[1], k.shape[1]
  if (cfg.attention_impl != "cudnn" or cap is not None) and 0 < cfg.attention_block < S:
    return ops.attention(q, k, v, kv_valid, scale, block=cfg.attention_block, kernels=cfg.kernels,
                         window=window, softcap=cap)
  mask = cache_lib.attention_mask(kv_valid, jnp.arange(S - T, S), jnp.arange(S), window)
  if cap is not None:
    return ops.xla.dense_attention(q, k, v, mask, scale, cap)
  return jax.nn.dot_product_attention(q, k, v, scale=scale, implementation=cfg.attention_impl,
                                      mask=mask)


def forward(cfg: ModelConfig, params: Params, tokens: jax.Array | None, positions=None, mask=None,
            *, embeddings: jax.Array | None = None) -> jax.Array:
  """The decoder as a pure function: final-normed hidden states [B, T, D], compute dtype.

  tokens: [B, T] int, or None with `embeddings` [B, T, D] given instead (input
  embeddings, e.g. to differentiate with respect to the input).
  mask: [B, T] bool, False for padding (default: all real).
  positions: [B, T] int (default: count of real tokens before each).
  The layers run under one `lax.scan` (rematerialised per layer with cfg.remat).
  """
  x, mask, positions = _inputs(cfg, params, tokens, mask, positions, embeddings)
  rope = _ropes(cfg, positions)

  def body(x, p):
    layer = p.get("layer")
    q, k, v = _layer_qkv(cfg, p, x, rope, layer)
    return _layer_finish(cfg, p, x, _attention(cfg, q, k, v, mask, layer))

  return _norm(cfg, _scan_layers(cfg, params, body, x), params["final_norm"])


def _inputs(cfg: ModelConfig, params, tokens, mask, positions, embeddings):
  """Checked (embeddings [B, T, D], mask [B, T] bool, positions [B, T])."""
  if embeddings is None:
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"tokens must be an int array [B, T], got {tokens.dtype}{list(tokens.shape)}")
    x = embed(cfg, params, tokens)
  else:
    x = jnp.asarray(embeddings).astype(cfg.dtype)
    if x.shape[2:] != (cfg.hidden_size,) or x.ndim != 3:
      raise ValueError(f"embeddings must be [B, T, {cfg.hidden_size}], got {list(x.shape)}")
  B, T = x.shape[:2]
  mask = jnp.ones((B, T), bool) if mask is None else jnp.asarray(mask).astype(bool)
  if mask.shape != (B, T):
    raise ValueError(f"mask shape {mask.shape} does not match tokens shape {(B, T)}")
  positions = default_positions(mask) if positions is None else jnp.asarray(positions)
  if positions.shape != (B, T):
    raise ValueError(f"positions shape {positions.shape} does not match tokens shape {(B, T)}")
  return x, mask, positions


def _scan_layers(cfg: ModelConfig, params: Params, body, carry, *, outputs: bool = False):
  """carry through body(carry, layer params) for each layer, under one lax.scan.

  With outputs=True, body returns (carry, y) and the ys are returned stacked [L, ...].
  Where layers differ in their attention (_per_layer), each one's params hold its
  index as p["layer"] (int32).
  """
  if cfg.remat not in (False, "none"):
    # Per-layer rematerialisation: the backward pass recomputes the layer from its
    # input ("full"), or from its input and its matmul outputs ("dots").
    policy = (jax.checkpoint_policies.dots_with_no_batch_dims_saveable if cfg.remat == "dots"
              else None)
    body = jax.checkpoint(body, prevent_cse=False, policy=policy)
  step = body if outputs else (lambda c, p: (body(c, p), None))
  xs = {n: params[n] for n in _layer_names(cfg, params)}
  if _per_layer(cfg):
    xs["layer"] = jnp.arange(cfg.num_layers, dtype=jnp.int32)
  carry, ys = jax.lax.scan(step, carry, xs)
  return (carry, ys) if outputs else carry


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
  xp = embed(cfg, params, prompt_tokens)
  xc = embed(cfg, params, tokens)
  prompt_mask, mask = prompt_mask.astype(bool), mask.astype(bool)
  # Positions and masks exactly as `forward` makes them for the concatenation
  # (kv_valid is each row's full prompt + completion mask).
  kv_valid = jnp.concatenate([jnp.repeat(prompt_mask, g, axis=0), mask], axis=1)
  rope_p = _ropes(cfg, default_positions(prompt_mask))
  rope_c = _ropes(cfg, default_positions(kv_valid)[:, P:])

  def body(x, p):
    xp, xc = x
    layer = p.get("layer")
    qp, kp, vp = _layer_qkv(cfg, p, xp, rope_p, layer)
    qc, kc, vc = _layer_qkv(cfg, p, xc, rope_c, layer)
    k = jnp.concatenate([jnp.repeat(kp, g, axis=0), kc], axis=1)
    v = jnp.concatenate([jnp.repeat(vp, g, axis=0), vc], axis=1)
    return (_layer_finish(cfg, p, xp, _attention(cfg, qp, kp, vp, prompt_mask, layer)),
            _layer_finish(cfg, p, xc, _attention(cfg, qc, k, v, kv_valid, layer)))

  xp, xc = _scan_layers(cfg, params, body, (xp, xc))
  norm = lambda x: _norm(cfg, x, params["final_norm"])  # noqa: E731
  return norm(xp), norm(xc)


# ---------------------------------------------------------------- decoding


def prefill(cfg: ModelConfig, params: Params, tokens: jax.Array, mask: jax.Array | None = None,
            *, group: int = 1, max_new_tokens: int) -> tuple[jax.Array, cache_lib.KVCache]:
  """Runs B left-padded prompts once and returns the cache that decodes B * group rows.

  tokens, mask: [B, P] (mask False on left padding). Rows b*group .. b*group +
  group - 1 of the decode share prompt b's keys and values, never copied.
  params: stacked (as the model holds them); the layers run under one lax.scan.
  Returns (final-normed hidden states [B, P, D], the cache with room for
  max_new_tokens decoded tokens per row). The next token of row n comes from
  the hidden state at P - 1 of its prompt: left padding ends every prompt there.
  """
  if group < 1 or max_new_tokens < 1:
    raise ValueError(f"group={group} and max_new_tokens={max_new_tokens} must be >= 1")
  x, mask, positions = _inputs(cfg, params, tokens, mask, None, None)
  B, P = x.shape[:2]
  rope = _ropes(cfg, positions)

  def body(x, p):
    layer = p.get("layer")
    q, k, v = _layer_qkv(cfg, p, x, rope, layer)
    return _layer_finish(cfg, p, x, _attention(cfg, q, k, v, mask, layer)), (k, v)

  # No remat: nothing is differentiated through a prefill.
  x, (ks, vs) = _scan_layers(cfg.replace(remat=False), params, body, x, outputs=True)
  # Each row's first decoded token sits one past its last real prompt token.
  first = jnp.repeat(jnp.sum(mask, axis=1, dtype=jnp.int32), group)
  cache = cache_lib.KVCache.after_prefill(
      ks, vs, mask, group=group, max_new_tokens=max_new_tokens,
      rope=_ropes(cfg, first[:, None] + jnp.arange(max_new_tokens)))
  return _norm(cfg, x, params["final_norm"]), cache


def decode_step(cfg: ModelConfig, params, tokens: jax.Array,
                cache: cache_lib.KVCache) -> tuple[jax.Array, cache_lib.KVCache]:
  """One decoding step of N rows: logits [N, V] float32 after tokens [N], and the cache.

  The token is written to completion slot cache.length of every row. params:
  as `decode_params` returns them (or stacked, slower: every step then slices
  the stacked weights). Layers run unrolled, each on its own cache buffers,
  updated in place: the caller's loop compiles each layer once.
  """
  N = tokens.shape[0]
  if N != cache.rows or tokens.ndim != 1:
    raise ValueError(f"decode_step takes tokens [N={cache.rows}], got {list(tokens.shape)}")
  slot = cache.length
  x = embed(cfg, params, tokens[:, None])  # [N, 1, D]
  rope = tuple(jax.lax.dynamic_slice_in_dim(t, slot, 1, axis=1) for t in cache.rope)
  prompt_visible = jnp.repeat(cache.prompt_valid, cache.group, axis=0)[:, None, :]  # [N, 1, P]
  own_visible = (jnp.arange(cache.max_new_tokens) <= slot)[None, None, :]
  # Slots as the forward counts them: the query at P + slot, prompt key p, own key t.
  P = cache.prompt_valid.shape[1]
  prompt_distance = P + slot - jnp.arange(P)
  own_distance = slot - jnp.arange(cache.max_new_tokens)
  ks, vs = [], []
  for i in range(cfg.num_layers):
    p = _layer_params(cfg, params, i)
    q, k, v = _layer_qkv(cfg, p, x, rope, i)
    k, v = cache_lib.write(cache.k[i], cache.v[i], k, v, slot)
    window = _window(cfg, i)
    if window is None:
      segments = [(cache.prompt_k[i], cache.prompt_v[i], prompt_visible, cache.group),
                  (k, v, own_visible, 1)]
    else:
      segments = [(cache.prompt_k[i], cache.prompt_v[i],
                   prompt_visible & (prompt_distance < window), cache.group),
                  (k, v, own_visible & (own_distance < window), 1)]
    attn = ops.decode_attention(q, segments, cfg.attention_scale, cfg.kernels,
                                softcap=cfg.attn_logit_softcap)
    x = _layer_finish(cfg, p, x, attn)
    ks.append(k)
    vs.append(v)
  logits = unembed(cfg, params, _norm(cfg, x[:, 0], params["final_norm"]))
  return logits, cache.replace(k=tuple(ks), v=tuple(vs), length=slot + 1)


def paged_decode_step(cfg: ModelConfig, params, tokens: jax.Array,
                      cache: cache_lib.PagedCache) -> tuple[jax.Array, cache_lib.PagedCache]:
  """One decoding step of S slots over a paged cache: logits [S, V] float32 after
  tokens [S], and the cache with their keys and values written.

  Slot s feeds the token at completion position cache.slot_position[s] of row
  cache.slot_row[s]; its keys and values go to the slot's page in progress,
  which is copied to its pool page cache.slot_page[s] when this token fills
  it. The caller (sampling/engine/) assigns rows and pages. Idle slots
  compute garbage logits and write no page. params: as `decode_params` returns them.
  """
  S = cache.slots
  if tokens.shape != (S,):
    raise ValueError(f"paged_decode_step takes tokens [S={S}], got {list(tokens.shape)}")
  x = embed(cfg, params, tokens[:, None])  # [S, 1, D]
  row = jnp.maximum(cache.slot_row, 0)
  positions = cache.prompt_length[row // cache.group] + cache.slot_position
  rope = _ropes(cfg, positions[:, None])
  offset = cache.slot_position % cache.page_size
  # A page full after this step's token is copied to the pool (after attention, which
  # reads it from the slot's buffer): ops.paged_decode_attention.
  flush = jnp.where((offset == cache.page_size - 1) & (cache.slot_row >= 0), cache.slot_page,
                    cache.num_pages)
  pool_mask = (cache.page_owner, cache.page_full())
  own_visible = cache.own_visible()
  kps, vps, sks, svs = [], [], [], []
  for i in range(cfg.num_layers):
    p = _layer_params(cfg, params, i)
    q, k, v = _layer_qkv(cfg, p, x, rope, i)
    window = _window(cfg, i)
    if window is not None:  # each slot's completion position, each page's first one's
      window = (window, cache.slot_position, cache.page_start)
    attn, (sk, sv), (kp, vp) = ops.paged_decode_attention(
        q[:, 0], (k[:, 0], v[:, 0]), offset, flush,
        (cache.prompt_k[i], cache.prompt_v[i], cache.prompt_valid, cache.group),
        (cache.k_pages[i], cache.v_pages[i], *pool_mask),
        (cache.slot_k[i], cache.slot_v[i], own_visible), cache.slot_row, cfg.attention_scale,
        cfg.kernels, window=window, softcap=cfg.attn_logit_softcap)
    x = _layer_finish(cfg, p, x, attn[:, None])
    kps.append(kp)
    vps.append(vp)
    sks.append(sk)
    svs.append(sv)
  logits = unembed(cfg, params, _norm(cfg, x[:, 0], params["final_norm"]))
  return logits, cache.replace(k_pages=tuple(kps), v_pages=tuple(vps), slot_k=tuple(sks),
                               slot_v=tuple(svs))


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
    """Logits [B, T, V] float32 for tokens [B, T] (positions/mask: see `forward`); with
    the score head, HF's sequence-classification logits [B, num_labels]
    (`sequence_scores`)."""
    if self.config.head == "score":
      return sequence_scores(self.config, self.param_dict(), tokens, mask, positions)
    return self.logits(self.hidden(tokens, positions, mask))

  def values(self, tokens, positions=None, mask=None) -> jax.Array:
    """The score head at every position [B, T, num_labels] float32 (a critic's values)."""
    return score(self.config, self.param_dict(), self.hidden(tokens, positions, mask))

  def hidden(self, tokens, positions=None, mask=None) -> jax.Array:
    """Final-normed hidden states [B, T, D] in the compute dtype (logits = logits(hidden))."""
    return forward(self.config, self.param_dict(), tokens, positions, mask)

  def logits(self, hidden: jax.Array) -> jax.Array:
    """Float32 logits [..., V] from hidden states [..., D]."""
    return unembed(self.config, self.param_dict(), hidden)

  def unembedding(self) -> jax.Array:
    """The output matrix [D, V] in the compute dtype: logits = hidden @ unembedding()."""
    return unembedding(self.config, self.param_dict())

  def prefill(self, tokens, mask=None, *, group: int = 1, max_new_tokens: int,
              all_logits: bool = False):
    """Run prompts tokens [B, P] (left-padded; mask [B, P]) once; see `prefill`.

    Returns (logits, cache for B * group rows): logits [B, 1, V] of the last
    position only (the one sampling needs; avoids a [B, P, V] tensor), or
    [B, P, V] with all_logits=True.
    """
    hidden, cache = prefill(self.config, self.param_dict(), tokens, mask, group=group,
                            max_new_tokens=max_new_tokens)
    return self.logits(hidden if all_logits else hidden[:, -1:]), cache

  def decode(self, tokens, cache: cache_lib.KVCache):
    """One step: tokens [N, 1] -> (logits [N, 1, V], cache); see `decode_step`."""
    logits, cache = decode_step(self.config, self.param_dict(), tokens[:, 0], cache)
    return logits[:, None], cache


# ---------------------------------------------------------------- building


def param_shardings(config: ModelConfig, mesh: jax.sharding.Mesh, rules=None):
  """{name: NamedSharding} for every parameter under the logical-axis `rules` dict
  (default: sharding.DEFAULT_RULES with the family's own additions, Architecture.sharding_rules)."""
  if rules is None:
    rules = {**sharding_lib.DEFAULT_RULES, **config.architecture.sharding_rules}
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
  params = {n: mesh_lib.put(a, shardings[n]) for n, a in model.param_dict().items()}
  out = Transformer(model.config, params=params)
  out.source_path = model.source_path
  return out
