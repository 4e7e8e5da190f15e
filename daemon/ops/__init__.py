"""Operator tools over the daemons' ops sockets: kvpushctl, doctor, the views they read, the one ops client."""
