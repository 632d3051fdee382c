"""Pipeline parallelism over the ``pp`` mesh axis: schedules as data
(:mod:`~functional_pp.parallel.pipeline.schedule`), their checker and simulated timing
(:mod:`~functional_pp.parallel.pipeline.timing`), and the layer-boundary hook that runs one
stage of a model (:mod:`~functional_pp.parallel.pipeline.stage`); docs/pipelines.md."""
