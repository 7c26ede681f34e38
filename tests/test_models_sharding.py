"""Loading onto a mesh of 8 fake CPU devices, and host memory while loading."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

import test_models_helpers as H
from grpojax import models
from grpojax.models import hf as hf_lib
from grpojax.models import safetensors_io


def _mesh(shape):
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py sets XLA_FLAGS for 8 fake CPU devices)")
  return Mesh(np.array(jax.devices()[:8]).reshape(shape), ("data", "fsdp", "tensor"))


@nnx.jit
def _logits(model, tokens, mask):
  return model(tokens, mask=mask)


def test_logical_to_spec_rules():
  mesh = _mesh((1, 2, 4))
  rules = models.DEFAULT_RULES
  assert models.logical_to_spec(("layers", "heads", "head_dim", "embed"), (2, 8, 16, 64), mesh,
                                rules) == PartitionSpec(None, "tensor", None, "fsdp")
  # 2 kv heads cannot split 4 ways: replicated rather than an error.
  assert models.logical_to_spec(("layers", "kv_heads", "head_dim", "embed"), (2, 2, 16, 64), mesh,
                                rules) == PartitionSpec(None, None, None, "fsdp")
  # A mesh axis is used once per array.
  assert models.logical_to_spec(("embed", "embed"), (8, 8), mesh, rules) == PartitionSpec("fsdp", None)


@pytest.mark.parametrize("shape", [(1, 8, 1), (1, 2, 4), (2, 2, 2)], ids=["fsdp", "tensor", "mixed"])
def test_sharded_load_matches_one_device(tmp_path_factory, shape):
  path = tmp_path_factory.getbasetemp() / "sharding_qwen3"
  if not path.exists():
    # 4 kv heads divide by tensor=4, so kv heads do split.
    H.hf_model("qwen3", seed=5, num_key_value_heads=4).save_pretrained(path)
  tokens, mask = H.left_padded(np.random.default_rng(0), [8, 5, 8, 3], 8, 97)
  tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
  single = models.from_pretrained(str(path), dtype="float32")
  mesh = _mesh(shape)
  sharded = models.from_pretrained(str(path), dtype="float32", mesh=mesh)

  spec = sharded.wq[...].sharding.spec
  want = {"fsdp": (None, None, None, "fsdp"), "tensor": (None, "tensor", None, "fsdp"),
          "mixed": (None, "tensor", None, "fsdp")}[{(1, 8, 1): "fsdp", (1, 2, 4): "tensor",
                                                    (2, 2, 2): "mixed"}[shape]]
  assert tuple(spec) + (None,) * (4 - len(spec)) == want
  assert len(sharded.wq[...].sharding.device_set) == 8
  np.testing.assert_allclose(_logits(sharded, tokens, mask), _logits(single, tokens, mask),
                             atol=1e-5)


_MEASURE = textwrap.dedent("""
    import os, sys, jax
    import jax.numpy as jnp
    from grpojax import models
    load = models.from_pretrained  # the face is lazy: the loader's modules come in here, not in the peak
    jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()  # backend up before the baseline
    def status(key):  # kB fields of /proc/self/status
      line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
      return int(line.split()[1]) * 1024
    base = status("VmRSS")
    model = load(sys.argv[1], dtype="float32")
    jax.block_until_ready(model.param_dict())
    print(base, status("VmHWM"))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_loading_peak_host_memory_below_twice_checkpoint(tmp_path):
  """Peak RSS growth while loading a ~100 MB float32 checkpoint, in a fresh process.

  Measured as VmHWM (this process's peak resident set, from /proc/self/status)
  minus VmRSS just before loading. The peak includes any earlier import spike, so
  the ratio errs high. (ru_maxrss would not do: Linux carries the forking pytest
  process's peak across exec.) The checkpoint is written one tensor at a time.
  """
  cfg = models.ModelConfig(vocab_size=32000, hidden_size=320, intermediate_size=1280,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=80)
  rng = np.random.default_rng(0)
  entries = [(name, shape, np.dtype(np.float32)) for name, _, _, shape in hf_lib.hf_tensors(cfg)]
  file = tmp_path / "model.safetensors"
  safetensors_io.write_file(str(file), entries,
                            lambda n: rng.standard_normal(dict((e[0], e[1]) for e in entries)[n],
                                                          np.float32))
  with open(tmp_path / "config.json", "w") as f:
    json.dump(hf_lib.config_to_hf(cfg), f)
  size = os.path.getsize(file)
  assert 90e6 < size < 110e6

  env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
  out = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path)], env=env, check=True,
                       capture_output=True, text=True, timeout=300).stdout.split()
  base, peak = int(out[-2]), int(out[-1])
  ratio = (peak - base) / size
  print(f"checkpoint {size / 1e6:.0f} MB, load peak RSS growth {ratio:.2f}x")
  assert ratio < 2.0
  assert ratio > 0.9  # the weights really were loaded into this process


def test_build_and_shard_model_on_mesh():
  mesh = _mesh((2, 2, 2))
  plain = models.build_model("tiny", seed=4)
  built = models.build_model("tiny", seed=4, mesh=mesh)  # created directly in shards
  moved = models.shard_model(plain, mesh)
  for model in (built, moved):
    assert model.w_up[...].sharding.spec == PartitionSpec(None, "tensor", "fsdp")
    # The same random bits through the same initialiser: equal up to how XLA:CPU
    # vectorises the elementwise maths of a sharded program (an ulp or two).
    for name, value in plain.param_dict().items():
      np.testing.assert_allclose(getattr(model, name)[...], value, rtol=1e-6, atol=0)
  tokens = jnp.asarray([[1, 2, 3, 4], [5, 6, 7, 8]])
  np.testing.assert_allclose(_logits(built, tokens, None), _logits(plain, tokens, None), atol=1e-5)
