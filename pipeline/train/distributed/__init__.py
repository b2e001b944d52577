"""Many workers, one model: DDP or FSDP, the process group and its network, collectives that cannot hang,
elastic worker groups, and which worker errors Ray Train retries."""
