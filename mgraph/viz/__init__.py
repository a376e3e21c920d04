"""Pictures of mgraph: benchmark charts (``plot``) and the offline HTML viewer (``view``).

matplotlib is imported only when a chart is drawn, so ``import mgraph.viz`` costs nothing and
works without it (``pip install 'mgraph[viz]'`` adds it).
"""

from __future__ import annotations

from typing import Any

__all__ = ["plot_rows", "plot_file", "view"]


def plot_rows(*args: Any, **kwargs: Any) -> Any:
    """See ``mgraph.viz.plot.plot_rows``."""
    from .plot import plot_rows as impl

    return impl(*args, **kwargs)


def plot_file(*args: Any, **kwargs: Any) -> Any:
    """See ``mgraph.viz.plot.plot_file``."""
    from .plot import plot_file as impl

    return impl(*args, **kwargs)



def view(*args: Any, **kwargs: Any) -> Any:
    """See ``mgraph.viz.html.view``: one offline HTML page of a graph, schedule and run."""
    from .html import view as impl

    return impl(*args, **kwargs)
