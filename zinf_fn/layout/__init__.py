"""The layout: the unit vocabulary (``units``), each group's read policy (``policy``), what each
streaming part demands (``demand``), a unit's weights over its rows (``rows``) and the layout step
that decides them all (``build``).

Nothing is imported here: the modules sit at different heights of the engine's import layers
(``units`` and ``demand`` at the bottom, ``build`` above ``config``), so each is imported by its
own name.
"""
