"""Ray runs, recorded like Dask runs: exporter bodies in, protocol records out.

Ray's aggregator agent POSTs JSON arrays of events (``storage.ray.wire`` and
``storage.ray.events`` read them). This package keeps them and turns them into what the rest
of Hindsight already indexes:

1. **The raw body is the source of truth.** Each body is stored, split per Ray session, under
   ``ray/v1/{tenant}/{cluster}/{session}/{sha256}.json.zst`` before it is acknowledged. Ray
   sends no batch identity, so the name is the content: a retried identical body is stored
   once, and the manifest (``ray_bodies``, unique per session and hash) merges it once.
2. **Merge tables** (``ray_jobs``, ``ray_tasks``, ``ray_nodes``, ``ray_workers``,
   ``ray_actors``) hold what the events say, merged commutatively: values are set while
   NULL, times take the earliest, flags OR. Events arrive in any order, from several nodes,
   at least once; a duplicate or reordered event changes nothing.
3. **A task reaches the writer once.** The rollups (histograms, per-worker sums, cluster
   hours, prefix days) add, so a task attempt must be counted exactly once, with its final
   start and stop. ``ray_tasks.emitted`` flips to true once, under the row's lock, so the
   transition happens in one transaction even with several collector processes. The merge
   that completes a task (its definition, RUNNING and end (FINISHED/FAILED) all known)
   flips it in the same statement and queues it in ``ray_ready``; the body's transaction or
   the sweeper (``storage.ray.sweep.emit_ready``) takes it from there and writes it. The
   sweeper (``storage.ray.sweep.run_due``) writes the rest, flipping ``emitted`` with
   ``UPDATE ... WHERE NOT emitted``: tasks whose end was seen ``settle`` seconds ago
   (RUNNING or the definition lost), every task of a job that has closed, and stragglers
   that arrive after.
4. **Emitted records are protocol batches** (``hindsight.schema``): tasks as ``TaskEvent``
   (Ray's own facts in ``attrs``), jobs as ``RunEvent``, worker processes as
   ``WorkerEvent`` (a worker's exit type translated to the protocol's departure,
   ``storage.ray.translate``). Each is stored under ``ray/derived/v1/...`` named by its
   content and indexed by the ordinary writer (``storage.ingest.writer.index_batch``), so
   runs, tasks, Parquet, quantiles, compare, histories, traces and pages work unchanged.
   Derived batches are outside ``v1/``: ``reindex`` rebuilds them from the raw bodies,
   never reads them.
5. **A job closes** ``settle`` seconds after its end was seen (the job's FINISHED, or its
   driver task's end), or after ``idle`` seconds without an event when neither arrives (a
   short script whose cluster died with it). Closing emits the job's remaining tasks (a task
   without an end is ``lost``) and the run's ``finished`` event.
"""
