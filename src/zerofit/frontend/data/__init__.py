"""The data a prepared loop reads: dataloaders sharded over processes, in Accelerate's sample order.

- `loaders`: the sharded dataloaders, even batches, the exact `gather_for_metrics`;
- `sampling`: the order of each epoch's samples, drawn as Accelerate draws it and kept exact on resume.
"""
