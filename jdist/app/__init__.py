"""`jdist train`: the training application built on the jdist library.

The command line (`cli`), its settings (`config`, `optimizer_spec`), the
training loop (`train`, `train_loop`, `train_guard`, `runlog`), and the model
zoo and datasets it trains on (`models`, `datasets`). A script that only
wants data-parallel training imports `jdist`, not this package.
"""
