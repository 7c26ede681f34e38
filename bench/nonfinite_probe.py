"""Looks for non-finite gradients in the KL-driven update over left-padded prompts (issue 17).

Random Qwen2.5-0.5B-shaped weights (LAYERS=24 by default; ZERO_PAD=1 zeroes the
pad row as HF's init does), 2 prompts of ~20 real tokens left-padded to 256,
G=8, 64 sampled tokens (~2% EOS per step, so rows end early), beta 0.04 with a
bf16 reference, zero advantages (the KL term alone). Prints loss, kl and the
parameters with non-finite gradients for each variant:

  python bench/nonfinite_probe.py base    # 8 variants of the loss's gradient
  python bench/nonfinite_probe.py real    # the trainer's own rollout + update, 2 steps
"""
import os, sys, time
import jax, jax.numpy as jnp, numpy as np
from grpojax.models import transformer
from grpojax.models.config import ModelConfig
from grpojax.core import losses, logprobs as lp_lib
from grpojax.train import step as step_lib
from grpojax.sampling import sampler
from grpojax.sampling.strategies import SamplingParams

QWEN05 = ModelConfig(arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                     num_layers=int(os.environ.get("LAYERS", 24)), num_heads=14, num_kv_heads=2,
                     head_dim=64, qkv_bias=True, tie_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6)
B, G, P, T, REAL = 2, 8, 256, 64, 20
EOS = tuple(range(2, QWEN05.vocab_size // 50))  # ~2% per step: some rows end early
t0 = time.time()
print(jax.devices(), jax.__version__, flush=True)
params = jax.jit(transformer.init_params, static_argnums=0)(QWEN05, jax.random.key(0))
if os.environ.get("ZERO_PAD"): params["embed"] = params["embed"].at[0].set(0.0)  # HF zeroes padding_idx at init
rng = np.random.default_rng(0)
pt = np.zeros((B, P), np.int32); pm = np.zeros((B, P), np.int32)
for b in range(B):
  n = REAL + 3 * b
  pt[b, P - n:] = rng.integers(3, 5000, n); pm[b, P - n:] = 1
cfg16 = QWEN05.replace(dtype="bfloat16")
out = sampler.generate_from_params(cfg16, params, jnp.asarray(pt), jnp.asarray(pm), rng=jax.random.key(1),
                                   num_samples=G, max_new_tokens=T, sampling=SamplingParams(1.0),
                                   eos_ids=EOS, pad_id=0)
toks, mask = out.tokens, out.mask
print("sample: tok min/max", int(toks.min()), int(toks.max()), "V", QWEN05.vocab_size,
      "lengths", np.asarray(out.lengths).tolist()[:8], "nonfinite sampler logps on mask",
      int(jnp.sum(~jnp.isfinite(out.logps) & (mask > 0))), f"{time.time()-t0:.0f}s", flush=True)
ref_params = {k: v.astype(jnp.bfloat16) for k, v in params.items()}
ptN, pmN = jnp.repeat(jnp.asarray(pt), G, 0), jnp.repeat(jnp.asarray(pm), G, 0)

def report(name, cfg, ref_cfg=None, rp=None, group=G, tokens=toks, m=mask, p_t=ptN, p_m=pmN, adv=None, beta=0.04,
           loss_type="grpo"):
  t1 = time.time()
  ref_cfg = ref_cfg or cfg16
  rp = ref_params if rp is None else rp
  ref = jax.jit(lambda rp: step_lib.completion_logps(ref_cfg, rp, p_t, p_m, tokens, m, group_size=group))(rp)
  a = jnp.zeros((tokens.shape[0],)) if adv is None else adv
  lc = losses.LossConfig(loss_type=loss_type, beta=beta)
  def loss_fn(p):
    logps, ent = step_lib.completion_logps(cfg, p, p_t, p_m, tokens, m, group_size=group, with_entropy=True)
    l, met = losses.policy_loss(logps, None, a, m, config=lc, ref_logps=ref, entropy=ent)
    return l, (met, logps)
  (l, (met, logps)), g = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
  bad = {k: int(jnp.sum(~jnp.isfinite(v))) for k, v in g.items()}
  bad = {k: v for k, v in bad.items() if v}
  print(f"{name:34s} loss {float(l):.3g} kl {float(met['kl']):.3g} ent {float(met['entropy']):.3g} "
        f"ref_nonfinite(mask) {int(jnp.sum(~jnp.isfinite(ref) & (m > 0)))} ref_nonfinite(all) {int(jnp.sum(~jnp.isfinite(ref)))} "
        f"logp_nonfinite(all) {int(jnp.sum(~jnp.isfinite(logps)))} gradnorm {float(jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in g.values()))):.3g} "
        f"bad {dict(list(bad.items())[:6])} [{time.time()-t1:.0f}s]", flush=True)
  if bad:
    per_layer = {k: np.flatnonzero(np.asarray(jnp.any(~jnp.isfinite(g[k].reshape(g[k].shape[0], -1)), axis=1))).tolist()
                 for k in bad if g[k].ndim >= 2 and g[k].shape[0] == cfg.num_layers}
    print("   NaN layers per param:", {k: (v[:3], v[-3:], len(v)) for k, v in per_layer.items()}, flush=True)
    # Is the cotangent into the hidden states already NaN (log-prob / loss part), or does it turn NaN in the model?
    from grpojax.models import transformer as tr
    def head(h):
      l = lp_lib.chunked_token_logprobs(h, tr.unembedding(cfg, params), tokens, with_entropy=False)
      return losses.policy_loss(l, None, a, m, config=lc, ref_logps=ref)[0]
    hp, hc = tr.forward_shared_prompt(cfg, params, p_t[::group], p_m[::group], tokens, m) if group > 1 else (None, None)
    if group > 1:
      hidden = jnp.concatenate([jnp.repeat(hp[:, -1:], group, axis=0), hc[:, :-1]], axis=1)
      gh = jax.grad(head)(hidden)
      print("   hidden nonfinite", int(jnp.sum(~jnp.isfinite(hidden))), "d hidden nonfinite", int(jnp.sum(~jnp.isfinite(gh))),
            "prompt hidden nonfinite", int(jnp.sum(~jnp.isfinite(hp))), "max|hidden|", float(jnp.max(jnp.abs(hidden.astype(jnp.float32)))), flush=True)
  return bad

which = sys.argv[1:] or ["base"]
if "base" in which:
  report("bf16 shared-prompt (as shipped)", cfg16)
  report("bf16 no shared prompt", cfg16, group=1)
  report("f32 shared-prompt", QWEN05)
  report("bf16 ref==policy dtype f32 ref", cfg16, ref_cfg=QWEN05, rp=params)
  report("bf16 beta=0 adv random", cfg16, beta=0.0, adv=jnp.asarray(rng.normal(size=B*G), jnp.float32))
  # no padding: the real tokens only
  ptn = ptN[:, -REAL:]; pmn = jnp.ones_like(ptn)
  report("bf16 no padding (P=20)", cfg16, p_t=ptn, p_m=pmn)
  rt = jnp.where(mask > 0, jnp.asarray(rng.integers(3, 5000, toks.shape), jnp.int32), 0)
  report("bf16 random tokens, same mask", cfg16, tokens=rt)
  report("bf16 all-ones mask", cfg16, m=jnp.ones_like(mask))

if "real" in which:
  # The trainer's own programs: jitted rollout (sampler + host rewards + reference) and update.
  from grpojax import config as config_lib
  from grpojax.rewards.runtime.host import HostRewards
  from grpojax.train import optim, rollout as rollout_lib, state as state_lib
  for dtype, mbs in (("bfloat16", 1), ("bfloat16", 2), ("float32", 1)):
    cfg = QWEN05.replace(dtype=dtype)
    c = config_lib.get_config()
    c.optim.grad_accum_steps = mbs
    state = state_lib.create_train_state(cfg, params, optim.make_optimizer(c.optim, total_steps=10),
                                         with_reference=True)
    host = HostRewards([lambda completions, **kw: [0.0] * len(completions)], decode=lambda rows: ["x"] * len(rows),
                       lookup=lambda i: {"prompt": "p"}, num_workers=0)
    rcfg = rollout_lib.RolloutConfig(group_size=G, max_new_tokens=T, sampling=SamplingParams(1.0), eos_ids=EOS,
                                     pad_id=0, with_reference=True, with_old_logps=mbs > 1)
    roll = rollout_lib.make_rollout_fn(rcfg, host)
    batch = {"prompt_tokens": jnp.asarray(pt), "prompt_mask": jnp.asarray(pm), "example_ids": jnp.arange(B, dtype=jnp.int32)}
    for s_ in range(2):
      t1 = time.time()
      ro, rm = roll(state, batch, jax.random.key(10 + s_))
      state, um = step_lib.update(state, ro, jax.random.key(20 + s_), loss_config=losses.LossConfig(loss_type="grpo", beta=0.04),
                                  group_size=G, minibatches=mbs, grad_accum_steps=mbs)
      pf = all(bool(jnp.all(jnp.isfinite(v))) for v in state.params.values())
      print(f"real {dtype} mb={mbs} step {s_}: loss {float(um['loss']):.3g} kl {float(um['kl']):.3g} grad_norm {float(um['grad_norm']):.3g} "
            f"entropy {float(um['entropy']):.3g} params finite {pf} ref nonfinite {int(jnp.sum(~jnp.isfinite(ro.ref_logps)))} [{time.time()-t1:.0f}s]", flush=True)
