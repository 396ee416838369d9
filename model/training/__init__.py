"""Training and evaluation: configs, data, Multi30k, the trainer and its state, distillation,
evaluation (sacrebleu), shortlists built from training data, plots."""
