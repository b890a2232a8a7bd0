# SPDX-License-Identifier: MIT
# Sphinx configuration: the API reference from pyattn's NumPy-style docstrings (autodoc + napoleon)
# and the guides, with no theme or extension beyond what Sphinx ships. pyattn must be installed in
# the interpreter that runs Sphinx (autodoc imports it):
#
#   pip install ".[docs]"
#   python -m sphinx -W --keep-going -b html docs docs/_build/html

import pyattn

project = "pyattn"
author = "the pyattn authors"
copyright = "the pyattn authors, MIT License"
release = pyattn.__version__
version = release

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]

# The docstrings are NumPy style; Google style is not used.
napoleon_numpy_docstring = True
napoleon_google_docstring = False
napoleon_use_rtype = False  # return types inline with their description, not cross-referenced

autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the docstrings state the types

exclude_patterns = ["_build"]
html_theme = "alabaster"
