"""LoRA and QLoRA (models/lora.py, ops/quant.py): fresh adapters change nothing, an update
moves only the adapters, merged and unmerged forwards agree, the exported adapter gives
the same logits under peft on the PyTorch model, the quantisers' errors are within their
bounds, and a LoRA run resumes exactly and refuses another base."""

import copy
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import test_models_helpers as H
from grpojax import config as config_lib
from grpojax import models
from grpojax.core import losses
from grpojax.models import lora as lora_lib
from grpojax.models import transformer as T
from grpojax.ops import quant
from grpojax.sampling import sampler
from grpojax.train import loop
from grpojax.train import state as state_lib
from grpojax.train import step as step_lib
from grpojax.run import assemble as assemble_lib
from grpojax.run.settings import read as read_settings


G = 4
torch = H.torch


def _logits(cfg, params, tokens, mask=None):
  mask = np.ones(np.shape(tokens), bool) if mask is None else mask
  return np.asarray(_logits_jit(cfg, params, jnp.asarray(tokens), jnp.asarray(mask)))


_logits_jit = jax.jit(lambda cfg, params, tokens, mask: T.unembed(
    cfg, params, T.forward(cfg, params, tokens, None, mask)), static_argnums=0)


def _nonzero(adapters, seed=1, scale=0.1):
  """Adapters with B moved off zero, so they change the model."""
  keys = jax.random.split(jax.random.key(seed), len(adapters))
  return {k: v + scale * jax.random.normal(key, v.shape) if k.endswith("_lora_b") else v
          for key, (k, v) in zip(keys, sorted(adapters.items()))}


# ---------------------------------------------------------------- quantisers


def test_nf4_levels_are_the_published_table():
  # QLoRA (Dettmers et al. 2023), Appendix E / bitsandbytes' NF4 table.
  published = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
               -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
               0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
               0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
               0.7229568362236023, 1.0]
  np.testing.assert_allclose(quant.NF4_LEVELS, published, atol=1e-6)


@pytest.mark.parametrize("kind", quant.KINDS)
def test_quantisers_round_to_the_nearest_level_within_their_bound(kind):
  w = jax.random.normal(jax.random.key(0), (3, 5, 128)) * 0.02
  w = w.at[0, 0, :64].set(0.0)  # an all-zero block dequantises to zeros
  q = quant.quantize(w, kind)
  back = np.asarray(q.dequantize(jnp.float32))
  assert q.shape == w.shape
  w = np.asarray(w)
  block = quant.block_size(kind, 128)
  absmax = np.abs(w.reshape(3, 5, -1, block)).max(-1, keepdims=True)
  err = np.abs(back - w).reshape(3, 5, -1, block)
  assert np.all(err <= quant.max_relative_error(kind) * absmax * (1 + 1e-6) + 1e-12)
  np.testing.assert_array_equal(back[0, 0, :64], 0.0)
  # Nearest level, by brute force over the levels.
  x = (w.reshape(3, 5, -1, block) / np.where(absmax > 0, absmax, 1))
  levels = quant.NF4_LEVELS if kind == "nf4" else np.arange(-127, 128) / 127
  nearest = levels[np.abs(x[..., None] - levels).argmin(-1)] * absmax
  np.testing.assert_allclose(back.reshape(nearest.shape), nearest, rtol=1e-6, atol=1e-9)
  # Storage: one byte per int8 weight, half a byte per nf4 weight, plus float32 scales.
  assert q.codes.nbytes == w.size // (2 if kind == "nf4" else 1)


# ---------------------------------------------------------------- the forward


@pytest.fixture(scope="module")
def tiny():
  model = models.build_model("tiny", seed=0)
  tokens = jax.random.randint(jax.random.key(2), (2, 7), 1, model.config.vocab_size)
  return model.config, model.param_dict(), tokens


def test_targets_parse_as_lists_hf_names_and_regexes():
  assert lora_lib.target_weights("all") == tuple(lora_lib.TARGETS.values())
  assert lora_lib.target_weights("q,v") == ("wq", "wv")
  assert lora_lib.target_weights("q_proj, v_proj") == ("wq", "wv")
  assert lora_lib.target_weights(["down_proj", "o"]) == ("wo", "w_down")
  assert lora_lib.target_weights("gate|up|down") == ("w_gate", "w_up", "w_down")
  assert lora_lib.target_weights(".*_proj") == tuple(lora_lib.TARGETS.values())
  for bad in ("qq", "x|y", "q,("):
    with pytest.raises(ValueError, match="model.lora.targets"):
      lora_lib.target_weights(bad)


def test_fresh_adapters_leave_the_logits_exactly_unchanged(tiny):
  cfg, params, tokens = tiny
  lora = lora_lib.LoraConfig(rank=4, alpha=8)
  adapters = lora_lib.init_adapters(cfg, lora, jax.random.key(1))
  assert all(float(jnp.abs(v).max()) > 0 for k, v in adapters.items() if k.endswith("_lora_a"))
  with_lora = cfg.replace(lora_scale=lora.scale)
  np.testing.assert_array_equal(_logits(with_lora, {**params, **adapters}, tokens),
                                _logits(cfg, params, tokens))


def test_adapters_add_scale_times_BA_to_their_weights(tiny):
  """The unmerged forward against the same model with W + (alpha/r) B A written in (float32),
  and against the base: each targeted projection, and only those, changes."""
  cfg, params, tokens = tiny
  lora = lora_lib.LoraConfig(rank=4, alpha=8, targets="q,down")
  adapters = _nonzero(lora_lib.init_adapters(cfg, lora, jax.random.key(1)))
  assert sorted(adapters) == ["w_down_lora_a", "w_down_lora_b", "wq_lora_a", "wq_lora_b"]
  by_hand = dict(params)
  for w in ("wq", "w_down"):
    b, a = np.asarray(adapters[w + "_lora_b"]), np.asarray(adapters[w + "_lora_a"])
    by_hand[w] = params[w] + (2.0 * np.einsum("lor,lri->loi", b, a)).reshape(params[w].shape)
  c = cfg.replace(lora_scale=lora.scale)
  ours = _logits(c, {**params, **adapters}, tokens)
  np.testing.assert_allclose(ours, _logits(cfg, by_hand, tokens), atol=2e-5, rtol=0)
  assert np.abs(ours - _logits(cfg, params, tokens)).max() > 1e-2


def test_merged_and_unmerged_agree_in_float32_and_bfloat16(tiny):
  cfg, params, tokens = tiny
  lora = lora_lib.LoraConfig(rank=8, alpha=16)
  adapters = _nonzero(lora_lib.init_adapters(cfg, lora, jax.random.key(1)))
  for dtype, tol in (("float32", 2e-5), ("bfloat16", None)):
    c = cfg.replace(lora_scale=lora.scale, dtype=dtype)
    base = {k: v.astype(dtype) for k, v in params.items()}
    unmerged = _logits(c, {**base, **adapters}, tokens)
    merged = _logits(c, lora_lib.merge({**base, **adapters}, lora.scale), tokens)
    if tol is None:  # bf16: the merged weights are rounded once more, to bf16's 2^-8
      exact = _logits(cfg.replace(lora_scale=lora.scale), {**params, **adapters}, tokens)
      tol = 4 * np.abs(unmerged - exact).max()  # within a few roundings of the float32 model
    np.testing.assert_allclose(merged, unmerged, atol=tol, rtol=0)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
  """A random Qwen2-family model (tied embeddings, q/k/v biases) in HF format, loaded."""
  hf = H.hf_model("qwen2", seed=3)  # unit-scale random weights, biases and norms
  path = tmp_path_factory.mktemp("qwen2")
  hf.save_pretrained(path)
  return hf, str(path), models.from_pretrained(str(path), dtype="float32")


@pytest.mark.parametrize("kind", quant.KINDS)
def test_quantised_base_logits_within_the_quantisers_error(qwen2, kind):
  """The tolerance, from the quantiser: with e = ||W - Q(W)|| / ||W|| over the seven
  projection kinds (~0.006 for int8, ~0.09 for nf4 on these weights), each matmul's
  output moves by about e relative to itself; each sublayer (attention, MLP) has two
  matmuls in series, and the 2L sublayers' independent errors add in quadrature, so the
  logits move by about sqrt(2 * 2L) * e relative to their RMS. The test holds them to
  that, and to at least e / 4 (the quantised weights are really used)."""
  _, _, model = qwen2
  cfg, params = model.config, model.param_dict()
  tokens, mask = H.left_padded(np.random.default_rng(0), [9, 5], 9, cfg.vocab_size)
  base = _logits(cfg, params, tokens, mask)
  frozen = lora_lib.frozen_base(params, lora_lib.LoraConfig(rank=4, quantize=kind), "float32")
  num = sum(float(jnp.sum((frozen[n].dequantize(jnp.float32) - params[n]) ** 2))
            for n in lora_lib.TARGETS.values())
  e = np.sqrt(num / sum(float(jnp.sum(params[n] ** 2)) for n in lora_lib.TARGETS.values()))
  assert e < (0.01 if kind == "int8" else 0.12)
  diff = (_logits(cfg, frozen, tokens, mask) - base)[mask]
  rel = np.sqrt(np.mean(diff**2)) / np.sqrt(np.mean(base[mask] ** 2))
  assert e / 4 < rel < np.sqrt(4 * cfg.num_layers) * e


def test_a_qlora_base_is_quantised_as_it_loads(qwen2, monkeypatch):
  """The loop loads a QLoRA base through hf.load_params(quantize=...): each projection is
  quantised as it is placed and its full-precision copy freed before the next is read,
  so the base never exists whole in model.dtype (Qwen2.5-7B on a 16 GB chip). The result
  is frozen_base's quantisation of the same weights, which it then keeps as it is."""
  _, path, model = qwen2
  lora = lora_lib.LoraConfig(rank=4, quantize="nf4")
  seen, real = [], lora_lib.quantize_weight

  def spy(w, kind, *, release=False):
    assert all(x.is_deleted() for x in seen), "a projection's full copy outlived its codes"
    seen.append(w)
    return real(w, kind, release=release)

  monkeypatch.setattr(lora_lib, "quantize_weight", spy)
  cfg = config_lib.get_config()
  cfg.model.path, cfg.model.dtype = path, "float32"
  cfg.model.lora.rank, cfg.model.lora.quantize = 4, "nf4"
  got_cfg, got = assemble_lib.load_model(read_settings(cfg), model.config, mesh=None)
  assert len(seen) == len(lora_lib.TARGETS) and all(x.is_deleted() for x in seen)
  monkeypatch.undo()
  want = lora_lib.frozen_base(model.param_dict(), lora, "float32")
  for name, w in want.items():
    for a, b in zip(jax.tree.leaves(got[name]), jax.tree.leaves(w)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
  kept = lora_lib.frozen_base(got, lora, got_cfg.dtype, release=True)
  assert all(kept[n] is got[n] for n in lora_lib.TARGETS.values())
  with pytest.raises(ValueError, match=r"^w_down is quantised to nf4, model.lora.quantize is int8$"):
    lora_lib.frozen_base(got, lora_lib.LoraConfig(rank=4, quantize="int8"), "float32")


def test_qlora_decodes_from_quantised_weights(tiny):
  """decode_params keeps a quantised base quantised (no fused bf16 copy); decoding then
  gives the full forward's logits."""
  cfg, params, tokens = tiny
  lora = lora_lib.LoraConfig(rank=4, alpha=8, quantize="nf4")
  full = {**lora_lib.frozen_base(params, lora, "float32"),
          **_nonzero(lora_lib.init_adapters(cfg, lora, jax.random.key(1)))}
  c = cfg.replace(lora_scale=lora.scale, kernels="xla")
  dp = T.decode_params(c, full)
  assert isinstance(dp["layers"][0]["wq"], quant.QuantizedWeight) and "wq_lora_a" in dp["layers"][0]
  want = _logits(c, full, tokens)
  _, cache = jax.jit(T.prefill, static_argnums=0, static_argnames="max_new_tokens")(
      c, full, tokens[:, :4], max_new_tokens=3)
  step = jax.jit(T.decode_step, static_argnums=0)
  for t in range(4, 7):
    logits, cache = step(c, dp, tokens[:, t], cache)
    np.testing.assert_allclose(np.asarray(logits), want[:, t], atol=2e-4, rtol=0)


# ---------------------------------------------------------------- training


@pytest.fixture(scope="module")
def rollout():
  model = models.build_model("tiny", seed=0)
  prompts = jnp.array([[0, 5, 6, 7], [3, 4, 9, 5]], jnp.int32)
  pmask = (prompts > 0).astype(jnp.int32)
  out = sampler.generate(model, prompts, pmask, rng=jax.random.key(0), num_samples=G,
                         max_new_tokens=6, eos_ids=[1, 2], pad_id=0)
  return model, step_lib.Rollout(
      prompt_tokens=jnp.repeat(prompts, G, axis=0), prompt_mask=jnp.repeat(pmask, G, axis=0),
      tokens=out.tokens, mask=out.mask,
      advantages=jnp.array([1.0, -1.0, 0.5, -0.5, -1.0, 1.0, 0.2, -0.2]))


_logps = jax.jit(step_lib.completion_logps, static_argnums=0)


@pytest.mark.slow
def test_updates_move_only_the_adapters_and_the_reference_is_the_base(rollout):
  model, ro = rollout
  lora = lora_lib.LoraConfig(rank=4, alpha=8)
  state = state_lib.create_train_state(model.config, model.param_dict(), optax.adam(1e-2),
                                       with_reference=True, lora=lora)
  assert state.ref_params is None and set(state.params) == set(lora_lib.adapter_specs(
      model.config, lora))
  # The optimizer holds moments for the adapters alone.
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
  assert sum(x.size for x in moments) == 2 * sum(x.size for x in state.params.values())
  frozen = jax.tree.map(np.array, state.frozen)
  ref_cfg, ref_params = state.reference()
  assert not any(lora_lib.is_adapter(n) for n in ref_params)
  ref = _logps(ref_cfg, ref_params, ro.prompt_tokens, ro.prompt_mask, ro.tokens, ro.mask)
  ro = ro.replace(ref_logps=ref)
  cfg = losses.LossConfig(loss_type="grpo", beta=0.1)
  for i in range(3):
    state, metrics = step_lib.update(state, ro, jax.random.key(i), loss_config=cfg, group_size=G)
  assert float(metrics["kl"]) > 0  # the policy left the base; the base did not move
  for got, want in zip(jax.tree.leaves(state.frozen), jax.tree.leaves(frozen)):
    np.testing.assert_array_equal(np.asarray(got), want)
  assert all(float(jnp.abs(v).max()) > 0 for k, v in state.params.items() if k.endswith("_lora_b"))
  # The base's log-probs are the reference's, before and after.
  again = _logps(*state.reference(), ro.prompt_tokens, ro.prompt_mask, ro.tokens, ro.mask)
  np.testing.assert_array_equal(np.asarray(again), np.asarray(ref))


def test_the_planner_holds_the_state_a_qlora_run_creates():
  """plan.abstract_state (what plan.fit and `python -m grpojax.plan` count) against the
  state create_train_state makes: the same arrays, shapes, dtypes and shardings, on a mesh
  of 8 devices; and fewer bytes than full fine-tuning's."""
  from grpojax import plan as plan_lib
  from grpojax.parallel import mesh as mesh_lib
  from grpojax.train import wiring
  cfg = config_lib.get_config()
  cfg.loss.beta, cfg.model.dtype = 0.04, "bfloat16"
  cfg.model.lora.rank, cfg.model.lora.quantize = 8, "nf4"
  cfg.mesh.shape = {"data": 1, "fsdp": 4, "tensor": 2}
  mesh = mesh_lib.make_mesh(cfg.mesh.shape.to_dict())
  run = read_settings(cfg)
  model_cfg = wiring.model_config(run, wiring.run_tokenizer(run)).replace(
      hidden_size=128, intermediate_size=256, num_heads=8, num_kv_heads=4)
  planned = plan_lib.abstract_state(run, model_cfg, mesh)
  model = models.build_model(model_cfg, mesh=mesh)
  real = state_lib.create_train_state(model.config, model.param_dict(), wiring.optimizer(run),
                                      with_reference=True, lora=run.model.lora)
  assert jax.tree.structure(planned) == jax.tree.structure(real)
  for p, r in zip(jax.tree.leaves(planned), jax.tree.leaves(real)):
    assert (p.shape, p.dtype) == (r.shape, r.dtype)
    assert p.sharding.is_equivalent_to(r.sharding, len(p.shape)), (p.sharding, r.sharding)
  assert plan_lib.bytes_per_device(planned) == plan_lib.bytes_per_device(real)
  # Its start-up ("load"): the quantiser of the largest projection (w_gate here, as w_up
  # and w_down), the rest of the frozen base resident, the program's output that weight's.
  lower, resident = plan_lib.load_program(read_settings(cfg), model_cfg, mesh, planned)
  out = lower().out_info
  assert jax.tree.structure(out) == jax.tree.structure(real.frozen["w_gate"])
  assert resident + plan_lib.bytes_per_device(real.frozen["w_gate"]) == (
      plan_lib.bytes_per_device(real.frozen))
  cfg.model.lora.rank, cfg.model.lora.quantize = 0, "none"
  full = plan_lib.bytes_per_device(plan_lib.abstract_state(read_settings(cfg), model_cfg, mesh))
  assert plan_lib.bytes_per_device(planned) < full
  assert plan_lib.load_program(read_settings(cfg), model_cfg, mesh, planned) is None


# ---------------------------------------------------------------- PEFT export


def test_exported_adapter_loads_in_peft_with_the_same_logits(qwen2, tmp_path):
  peft = pytest.importorskip("peft")
  hf, base_dir, model = qwen2
  lora = lora_lib.LoraConfig(rank=4, alpha=12, targets="q,k,v,o,gate,up,down")
  state = state_lib.create_train_state(model.config, model.param_dict(), optax.adam(1e-3),
                                       with_reference=False, lora=lora)
  state = state.replace(params=_nonzero(state.params, scale=0.2))
  from grpojax.train import checkpoint
  out = checkpoint.export_hf(state, str(tmp_path / "adapter"), base_path=base_dir,
                             merged=str(tmp_path / "merged"))
  config = json.load(open(os.path.join(out, "adapter_config.json")))
  assert config["r"] == 4 and config["lora_alpha"] == 12 and config["base_model_name_or_path"] == base_dir
  # Back into grpojax, the same adapters.
  back = lora_lib.load_peft(model.config, lora, out)
  for k, v in state.params.items():
    np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(v))

  tokens, mask = H.left_padded(np.random.default_rng(0), [9, 6], 9, hf.config.vocab_size)
  ours = _logits(state.model_config, state.model_params, tokens, mask)
  base_logits = H.hf_logits(hf, tokens, mask)
  with_adapter = peft.PeftModel.from_pretrained(copy.deepcopy(hf), out).eval()
  theirs = H.hf_logits(with_adapter, tokens, mask)
  assert np.abs(theirs - base_logits)[mask].max() > 0.1  # the adapter is applied
  np.testing.assert_allclose(ours[mask], theirs[mask], atol=1e-4, rtol=0)
  merged = H.transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged",
                                                               dtype=torch.float32).eval()
  np.testing.assert_allclose(H.hf_logits(merged, tokens, mask)[mask], theirs[mask], atol=1e-4,
                             rtol=0)


# ---------------------------------------------------------------- config and the loop


def _bad(**keys):
  cfg = config_lib.get_config()
  for key, value in keys.items():
    section, *rest = key.split("__")
    target = cfg[section]
    for part in rest[:-1]:
      target = target[part]
    target[rest[-1]] = value
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(cfg)
  return str(e.value)


def test_bad_lora_keys_stop_with_one_line():
  assert "model.lora.rank=-1" in _bad(model__lora__rank=-1)
  assert "model.lora.alpha=0.0" in _bad(model__lora__rank=4, model__lora__alpha=0.0)
  assert "model.lora.targets" in _bad(model__lora__rank=4, model__lora__targets="attn")
  assert "model.lora.quantize='nf3'" in _bad(model__lora__rank=4, model__lora__quantize="nf3")
  assert "needs adapters" in _bad(model__lora__quantize="nf4")
  assert "train.ref_sync_every" in _bad(model__lora__rank=4, train__ref_sync_every=2)
  for message in (_bad(model__lora__rank=-1), _bad(model__lora__quantize="nf4")):
    assert "\n" not in message


sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "experiments"))
import arithmetic_tiny  # noqa: E402


def _run_config(steps, **lora):
  c = arithmetic_tiny.get_config("smoke")
  c.train.steps, c.train.save_every, c.train.eval_every = steps, 1, 0
  c.rollout.prompts_per_step, c.rollout.group_size = 4, 4
  c.eval.num_prompts = 0
  c.sft.steps = 2  # SFT trains the adapters too
  c.loss.beta = 0.04  # the reference forward runs on the base
  c.model.lora.rank, c.model.lora.alpha = 4, 8.0
  for k, v in lora.items():
    c.model.lora[k] = v
  return c


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [{k: v for k, v in m.items() if not k.startswith(("time/", "step_time"))} for m in rows]


def test_checkpoints_restore_the_adapters_exactly_and_refuse_another_base(rollout, tmp_path):
  from grpojax.train import checkpoint
  model, _ = rollout
  lora = lora_lib.LoraConfig(rank=4, alpha=8, quantize="nf4")
  fresh = lambda: state_lib.create_train_state(  # noqa: E731
      model.config, model.param_dict(), optax.adam(1e-2), with_reference=False, lora=lora, seed=3)
  state = fresh()
  state = state.replace(params=_nonzero(state.params), step=state.step + 5)
  base = checkpoint.base_identity("", arch="tiny", seed=0)
  ckpt = checkpoint.Checkpointer(str(tmp_path / "c"), async_save=False, base=base)
  ckpt.save(5, state, {"data": {}})
  restored, extra = ckpt.restore(fresh())
  assert extra["base"] == base and int(restored.step) == 5
  for got, want in zip(jax.tree.leaves((restored.params, restored.opt_state)),
                       jax.tree.leaves((state.params, state.opt_state))):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  ckpt.close()
  other = checkpoint.Checkpointer(str(tmp_path / "c"), async_save=False,
                                  base=checkpoint.base_identity("", arch="tiny", seed=1))
  with pytest.raises(checkpoint.CheckpointError, match="another base model"):
    other.restore_latest(fresh())
  # The loop hands its model's arrays over: the base is made in place, each quantised
  # original freed, so a base loads in its own size.
  given = {k: jnp.array(v, copy=True) for k, v in model.param_dict().items()}
  handed = state_lib.create_train_state(model.config, given, optax.adam(1e-2),
                                        with_reference=False, lora=lora, release=True)
  assert handed.frozen["embed"] is given["embed"] and given["wq"].is_deleted()
  # An HF directory's identity is its path and a fingerprint of its weights.
  model_dir = tmp_path / "m"
  models.save_pretrained(model, str(model_dir))
  first = checkpoint.base_identity(str(model_dir))
  assert first == checkpoint.base_identity(str(model_dir))
  changed = model.param_dict()
  changed["wq"] = changed["wq"] + 1e-3
  models.save_pretrained(models.Transformer(model.config, params=changed), str(model_dir))
  assert checkpoint.base_identity(str(model_dir))["sha256"] != first["sha256"]


@pytest.mark.slow
def test_a_qlora_run_with_sft_and_kl_trains_the_adapters_and_exports_them(tmp_path):
  summary = loop.train(_run_config(2, quantize="nf4"), str(tmp_path))
  rows = _metrics(str(tmp_path))
  assert summary["step"] == 2 and [m["step"] for m in rows] == [0, 1, 2]  # 0: SFT
  assert rows[-1]["kl"] > 0  # the policy (adapters on) left the reference (adapters off)
  assert sorted(os.listdir(os.path.join(tmp_path, "hf")))[:2] == [
      "adapter_config.json", "adapter_model.safetensors"]
