"""``infinity train``: train a GPT beyond the memory budgets, or fine-tune a local
``transformers`` model. ``infinity/cli/main.py`` needs only :func:`add_arguments`
and :func:`run`.

Where to read, in the order a run meets them:

- ``args.py``: the flags; ``settings.py``: flags, presets, a config file or a
  resumed run's settings resolved into one ``RunSettings``;
- ``command.py``: ``run``, the entry: launch or join the ranks, open the run
  directory, train, report;
- ``ranks.py``: ``--nproc`` (the launch, one process per rank) and a rank's view;
- ``checkpoints.py``: the run directories (``DIR/run-<id>/``, owned and
  locked) and their checkpoints, written and resumed;
- ``loop.py``: the session (model, optimizer, schedule) and one step;
  ``optimizers.py``: the ``--optimizer`` choices; ``pretrained.py``: ``--model
  DIR --data PATH``, a ``transformers`` model and the user's text;
- ``report.py``: the header, progress and summary; ``timeline_plot.py``: the
  memory-timeline PNG.
"""

from infinity.cli.train.args import add_arguments
from infinity.cli.train.command import run

__all__ = ["add_arguments", "run"]
