"""The executor: one loaded model on its devices, for every `tp` (`build_executor`).

The service layer sees it only through `executor.api` (`ModelExecutor`, `ServingEngine`);
tensor parallelism (communicators, sharding, the lockstep runner) is in `executor/tp/`.
"""
