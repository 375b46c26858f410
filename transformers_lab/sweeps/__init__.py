"""Jobs and sweeps: the job wrapper every ``tlab-train`` run goes through (``job``), the
typed record it leaves in ``result.json`` (``record``), the one reader of Hydra overrides
(``overrides``), and what reads the records back: the sweep summary and
``tlab-summarize`` (``summary``), and learning curves joined across resumes
(``curves``)."""
