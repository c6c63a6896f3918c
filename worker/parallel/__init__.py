"""A job as N ranks: the elastic launch from a fork server (launch.py) and each rank's share and
collectives (distributed.py). They import torch and `service.core`, never the store."""
