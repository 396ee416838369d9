"""Serving translations: the translate use case (grouping, detection, pivots, limits), the
service per model, the batch scheduler and the model thread that runs it, the app's state."""
