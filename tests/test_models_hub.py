"""model.path may be a Hugging Face Hub id: resolved through the local hub cache first
(a cache the test builds; no network), honouring offline mode with one clear line."""

import os

import numpy as np
import pytest

from grpojax import config as config_lib
from grpojax import models
from grpojax.models import hf
from grpojax.models.tokenizers import CharTokenizer
from grpojax.train import wiring
from grpojax.run import assemble as assemble_lib
from grpojax.run.settings import read as read_settings


@pytest.fixture
def hub(tmp_path, monkeypatch):
  """A hub cache holding testorg/tiny (a tiny model and its tokenizer), offline mode on."""
  from huggingface_hub import constants

  cache = tmp_path / "hub"
  commit = "0123456789abcdef0123456789abcdef01234567"
  repo = cache / "models--testorg--tiny"
  snapshot = repo / "snapshots" / commit
  model = models.build_model("tiny", vocab_size=CharTokenizer().vocab_size, seed=7)
  models.save_pretrained(model, str(snapshot), tokenizer=CharTokenizer())
  (repo / "refs").mkdir(parents=True)
  (repo / "refs" / "main").write_text(commit)
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  return model, str(snapshot)


def test_a_hub_id_loads_from_the_local_cache(hub):
  model, snapshot = hub
  cfg = config_lib.get_config()
  cfg.model.path = "testorg/tiny"
  config_lib.validate(cfg)  # not a directory here: a Hub id is resolved at start-up
  assert os.path.samefile(hf.local_dir("testorg/tiny"), snapshot)
  tokenizer = wiring.run_tokenizer(read_settings(cfg))
  run = read_settings(cfg)
  _, loaded = assemble_lib.load_model(run, wiring.model_config(run, tokenizer), mesh=None)
  for name, value in model.param_dict().items():
    np.testing.assert_array_equal(np.asarray(loaded[name]), np.asarray(value))
  assert tokenizer.encode("12+3=") == CharTokenizer().encode("12+3=")


def test_offline_and_not_cached_is_one_line(hub):
  with pytest.raises(config_lib.ConfigError) as e:
    hf.local_dir("testorg/absent")
  assert "\n" not in str(e.value) and "HF_HUB_OFFLINE is set" in str(e.value)
  assert "testorg/absent" in str(e.value)
  assert not hf.is_hub_id("./models/x") and not hf.is_hub_id("a/b/c")
