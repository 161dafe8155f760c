"""mixprec's version, in a leaf module so any layer can name it without importing the package's facade
(``mixprec/__init__.py`` re-exports it). Keep it equal to pyproject.toml's ``version``."""

__version__ = "0.1.0"
