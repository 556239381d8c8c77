"""The job runtime behind ``ridethrough run``: the shim in every rank, and the coordinator it talks to.

The launcher (`ridethrough.actuators.launcher`) puts ``site/sitecustomize.py`` first on the ranks'
``PYTHONPATH``; with ``RIDETHROUGH_SHIM=1`` it boots the shim (`boot`) before the script runs, and
does nothing otherwise. The script is not changed. In the rank: `discovery` (models, optimizers,
schedulers, step boundaries), `loaders` (data positions), `group` (the re-formable process
group), `ddp` (DDP's communication), `state` (capture, restore, transfer), `control` and
`recovery` (commands, taking over a rank, recovering from a loss). On the launcher's side:
`coordinator`, `supervisor` and `control_socket`; `keys` is the store layout both sides share.

What a script gets, and where the line is:

* Restored exactly: every model's and optimizer's and LR scheduler's state, the random
  generators (torch CPU and CUDA, numpy's global, Python's), the position of every
  ``torch.utils.data.DataLoader`` (epoch, batch, the shuffle), and the step count.
* Not restored: the script's own Python variables. A process that takes over a rank runs the
  script from its top: a loop over a data loader ends where the job ends; a loop bounded by its
  own counter runs past the others' end and is stopped when the job ends (its code after the loop
  does not run there: the other ranks' does). A script that makes its own batches (no
  DataLoader) gets its generators back at its first forward, after it drew its first batch.
* Reactive recovery takes the lost rank's model and optimizer from a peer that had not yet
  updated in the interrupted step (the usual case: a dead peer is noticed in the gradient
  all-reduce), and that peer's generators (the same stream when the ranks share a seed, as DDP
  scripts usually do). A loss noticed after an update (a collective the script issues after
  ``optimizer.step()``) has no peer copy: the coordinator falls back (snapshot restart).
* Collectives under the shim: all-reduce, broadcast, all-gather and barrier on the default group
  (what DDP and most scripts use); a DDP on an explicit other group stays plain DDP and a job using
  one cannot migrate. gloo is tested; NCCL takes the same paths (an inner ProcessGroupNCCL per
  generation) and is untested here.
"""
