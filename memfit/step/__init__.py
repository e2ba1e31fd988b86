"""The training step: the one piece of code the trainer runs and the planner traces on fake tensors.

It sits below both (``memfit.train`` runs it, ``memfit.planner`` traces it), so neither imports the other
to reach it.
"""
