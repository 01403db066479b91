"""SageMaker: the job environment (:mod:`.job`: one root, one "am I in a job" rule, the defaults a job implies)
and the image's ``train`` entrypoint (:mod:`.entrypoint`)."""
