"""On the PYTHONPATH of the matrix's ``epochcache run`` jobs: the run then finds matplotlib
unusable and writes no plot (seconds per job on a busy machine, and not what is tested)."""

raise ImportError("the resume matrix's runs write no plot")
