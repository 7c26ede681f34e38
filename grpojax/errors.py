"""The error every layer raises for a setting that cannot work.

It lives at the bottom so that the layers the config's values are read into (the
model loader's Hub download, the rewards' import of named functions) say what is
wrong in the config's own words, one line naming the key, without importing the
config.
"""


class ConfigError(ValueError):
  """A config value that cannot work; the message names the key."""
