"""One replica over several processes: tensor and/or pipeline parallelism (torch.distributed).

`group` joins the processes, `shard` splits a checkpoint by heads and vocabulary (`stages`
by layers, for pipeline parallelism, `micro_batches` cutting a step so stages overlap), `plan`
is the one message a step sends, `runner` drives the ranks from rank 0's scheduler and
`worker` is what the other ranks run, `setup` refuses what does not combine with it.
"""
