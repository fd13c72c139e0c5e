"""Checkpointing: saving, completion records, verified resume, preemption. See docs/resume.md.

  plan.py        the entry point: `plan_checkpointing(cfg)` -> resume point + callbacks in order
  resume.py      which checkpoint a run (or `llm generate/export`) starts from, verified
  manifest.py    what makes a checkpoint complete; how its files are checked
  saver.py       the save: Composer's saver decides when; a snapshot to host memory, written in the
                 background (torch.save / torch.distributed.checkpoint's async_save); a full disk
  schedule.py    when to save: batches, wall-clock time, auto; what a save costs as measured
  publisher.py   stores what Composer's saver wrote, writes manifests, moves latest.json, retention
  uploader.py    the background upload: one in flight per rank, settled at the next save or the end;
                 the end's one bound on waiting for storage (`Deadline`)
  sizes.py       a checkpoint's bytes per rank and node, bandwidths, the stall-free save interval
  restart.py     the `[restart]` line: where a resumed run's start-up time went
  local_copy.py  this node's copy of the newest checkpoint of an S3 run, reused at a restart here
  lock.py        the run lock: one run at a time per checkpoint folder (a lease with heartbeats)
  preemption.py  SIGTERM/SIGINT -> a checkpoint at the current batch (if it fits preemption.notice_s),
                 then exit 143/130 within what the signal leaves (`StopBudget`, a watchdog)
  rollback.py    where the guard rolls back to after a loss spike: `RollbackPoint`, the newest checkpoint
  records_hook.py  `RunRecordsHook`: what checkpointing asks of the run's records (a protocol)

Storage (local folder or S3, retries, atomic writes) is `storage`'s, not this package's; the run's
records (metrics, samples, plot, config) are `llm.run_dir`'s, handed in by the trainer. The
package imports nothing itself (import the module you need), so no module here imports its own
package's initialiser in a circle.
"""
