"""Data side of training a small DeepSeek-V4-architecture model on the Python standard library.

``corpus`` defines the corpus (a manifest of stdlib ``.py`` files) and the fixed held-out
split, ``vocab`` cuts the V4 vocabulary on the training split, ``baselines`` fits the
unigram and bigram models the trained model is measured against, and ``data`` ties them
together for ``sluice train data``. The model training stage is not built yet.
"""
