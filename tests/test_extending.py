"""A researcher's own module registers a loss type and uses it by name.

The module's code is README.md's example, verbatim, so the README cannot drift.
"""

import importlib.util
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax import config
from grpojax.core import losses

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture
def research_module(tmp_path):
  text = README.read_text()
  section = text[text.index("### Register a new loss"):]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  path = tmp_path / "my_research.py"  # outside the package, as a user's file
  path.write_text(code)
  spec = importlib.util.spec_from_file_location("my_research", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  yield module
  losses.LOSSES.pop("clipped_reinforce", None)


def test_readme_loss_is_registered_and_selectable_by_name(research_module):
  assert "clipped_reinforce" in losses.LOSSES
  cfg = config.get_config()
  cfg.loss.loss_type = "clipped_reinforce"
  config.validate(cfg)  # the config accepts the new name


def test_readme_loss_value_and_gradient(research_module):
  # On-policy the ratio is 1, so the weight is 1 and each token's loss is
  # -A_i * log(0.5); global_token_mean divides the sum by the 12 tokens:
  # -3 * log(0.5) * (1 - 1 + 0.5 - 0.5) / 12 = 0.
  assert float(research_module.loss) == pytest.approx(0.0, abs=1e-7)
  assert float(research_module.metrics["ratio/mean"]) == pytest.approx(1.0)

  cfg = losses.LossConfig(loss_type="clipped_reinforce", epsilon_high=0.28)
  adv = jnp.array([1.0, 0.0, 0.0, 0.0])
  logps = jnp.log(jnp.full((4, 3), 0.5))
  loss_fn = lambda lp: losses.policy_loss(lp, None, adv, jnp.ones((4, 3)), config=cfg)[0]
  # Only row 0 contributes: -3 * 1 * log(0.5) / 12.
  assert float(loss_fn(logps)) == pytest.approx(-3 * math.log(0.5) / 12, rel=1e-6)
  grad = np.asarray(jax.grad(loss_fn)(logps))
  np.testing.assert_allclose(grad[0], -1 / 12, rtol=1e-6)
  np.testing.assert_allclose(grad[1:], 0.0)


def test_readme_loss_reports_its_own_clip_metric(research_module):
  cfg = losses.LossConfig(loss_type="clipped_reinforce", epsilon_high=0.28)
  old = jnp.log(jnp.full((2, 2), 0.5))
  logps = old.at[0, 0].set(jnp.log(0.9))  # ratio 1.8 > 1.28 on one of 4 tokens
  _, metrics = losses.policy_loss(logps, old, jnp.array([1.0, 1.0]), jnp.ones((2, 2)), config=cfg)
  assert float(metrics["clip_ratio/high_mean"]) == pytest.approx(0.25)
