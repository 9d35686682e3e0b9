"""Training backends behind one surface (`tfbig.distribute.base.Strategy`).

The one place that knows every backend, the pipeline's included, and picks one for
`--strategy` is `tfbig.training.registry` (`get_strategy`). It is a module of its own, not
this package's __init__, so that importing any backend (which runs this file) never reaches the
registry, and through it the pipeline: the pipeline imports the data backends, never the reverse.
"""
