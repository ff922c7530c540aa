"""Ways in from other gateways: their config files as a switchyard config.

`switchyard-mw from-litellm config.yaml` prints LiteLLM proxy's config as switchyard TOML
(`litellm.translate_litellm`). Reading YAML needs the `migrate` extra (PyYAML).
"""

from .litellm import Translation, translate_litellm

__all__ = ["Translation", "translate_litellm"]
