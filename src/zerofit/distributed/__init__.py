"""Process-group plumbing shared by every layer: the run's environment (`runtime`), joining the
process group (`process_group`), a store server that only loopback reaches (`loopback`), naming a
collective that fails (`failures`), the labelled object collectives that the front end and the
checkpoint code use (`collectives`), and where each rank is at the few calls checked before their
collective (`arrival`)."""
