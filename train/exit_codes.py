"""Process exit statuses of `meshlm train`, for schedulers deciding whether to restart.

  0   finished: all config.steps done
  1   error: bad config, data or checkpoint (message on stderr); do not restart
  75  preempted: SIGTERM/SIGINT received, checkpoint written at the current step; restart
  76  hung: a step outlasted the watchdog's limit, all thread stacks dumped to the log; restart
  77  peer lost: another process of a multi-process run stopped answering; restart the job
"""

OK = 0
ERROR = 1
PREEMPTED = 75
HUNG = 76
PEER_LOST = 77
