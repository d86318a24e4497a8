"""Pluggable pipeline stages: write one class, name it in the configuration.

* :class:`~services.plugins.api.PromptStage` — a pre-processing stage that runs as its own
  service between the gateway and the tokenizer (``PD_PRE_STAGES``).
* :class:`~services.plugins.api.TextFilter` — a streaming filter over the generated text, run
  inside the postfilter (``PD_TEXT_FILTERS``).

See ``docs/stages.md``; ``services/plugins/examples.py`` has one of each.
"""
