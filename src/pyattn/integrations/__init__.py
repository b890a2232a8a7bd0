# SPDX-License-Identifier: MIT
"""Integrations of pyattn into other libraries, one module each, imported only when asked for:
``pyattn.integrations.transformers`` (Hugging Face transformers' attention interface)."""
