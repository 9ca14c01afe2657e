"""Process-group plumbing shared by every layer: the run's environment (`runtime`), joining the
process group (`process_group`), naming a collective that fails (`failures`), and the labelled
object collectives that the front end and the checkpoint code use (`collectives`)."""
