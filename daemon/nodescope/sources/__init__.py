"""Data sources: a pure parser and a thin reader each, every path through :class:`Roots`."""
