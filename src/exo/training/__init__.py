"""Training helpers (PyTorch, optional): the demo model and test fixtures use them.

Nothing under ``exo.training`` is imported by the runtime; it needs ``torch`` and
``transformers`` (the ``train`` extra).
"""
