"""Running a training from a config (docs/architecture.md, "The application layer"):
``world`` (device count, device), ``inputs`` (model, tokenizer, data), ``report`` (the
start-up summary), ``progress`` and ``metrics`` (progress line, metrics loggers),
``optimizer`` (the config's optimizer and schedule), ``loop`` (the training loop,
:func:`~functional_pp.app.loop.train`), ``evaluate`` (held-out loss), ``export`` (run ->
Hugging Face directory), ``plot`` and ``resume_check``."""
