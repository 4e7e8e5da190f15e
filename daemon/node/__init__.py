"""One node's process tree: the kvpushd command, the supervisor of the device daemons, sd_notify."""
