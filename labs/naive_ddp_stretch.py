"""Lab 6, stretch goal: NaiveDDP from an empty file.

Write, in this file and from nothing, a class `NaiveDDP` that lab 6's check accepts in place of
part 1 of labs/minddp.py. The contract (the same as part 1's):

- `NaiveDDP(module)` wraps a model the way DistributedDataParallel does: `wrapper.module` is the
  model, its parameters are the model's, and calling the wrapper calls the model with the same
  arguments;
- once it is built, every rank holds rank 0's parameters and buffers;
- `finish_gradient_synchronization()`, called after `loss.backward()` and before
  `optimizer.step()`, leaves in every trainable parameter's `.grad` the average over ranks; a rank
  whose parameter got no gradient this step contributes zeros, and still takes part.

Check it from the repository root (2 CPU processes; the same check as part 1: the transformer
against one process and torch's DDP, then the two small models):

    torchrun --standalone --nproc_per_node=2 labs/lab6_ddp_from_scratch.py --file labs/naive_ddp_stretch.py --impl naive

Untouched, this file makes the check stop with one line: it defines no NaiveDDP.
"""
