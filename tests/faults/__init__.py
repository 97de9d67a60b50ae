"""The fault matrix: real `gracelm serve` processes, real signals and real faults. Each case ends with the
check that no process, runtime directory, shared-memory segment or port of the server is left.
Each fault and its test, by file (35 cases):

test_drain.py:
  SIGTERM under load                   test_sigterm_lets_eight_streams_finish_and_reports_every_resource
  drain deadline                       test_shutdown_timeout_2_ends_long_streams_with_an_explicit_abort
  shutdown timeout 0                   test_shutdown_timeout_0_aborts_at_once
  double signal                        test_second_sigint_during_the_drain_stops_at_once
  SIGTERM to every process
    test_signals_to_every_process_give_one_orderly_drain[sigterm-to-every-process]
  Ctrl-C to the group
    test_signals_to_every_process_give_one_orderly_drain[sigint-to-the-group]
  SIGHUP to the group
    test_signals_to_every_process_give_one_orderly_drain[sighup-to-the-group]
test_startup_faults.py:
  signal during start-up               test_sigterm_while_the_weights_load_abandons_the_start
  port taken                           test_port_in_use_is_a_startup_failure
  missing model                        test_missing_model_is_a_startup_failure
  unreadable model                     test_an_unreadable_weights_file_exits_3_naming_it
test_core_faults.py:
  kill -9 of the core, busy            test_kill_9_of_the_engine_core_under_load_is_fatal_within_2_s
  kill -9 of the core, idle            test_kill_9_of_an_idle_core_is_fatal_within_2_s
  SIGSTOP of the core, busy            test_sigstop_of_a_busy_core_is_fatal_within_the_hang_timeout
  SIGSTOP of the core, idle
    test_sigstop_of_an_idle_core_then_a_request_is_fatal_within_the_hang_timeout
  exception in the core                test_sigusr1_dumps_every_stack_then_an_injected_exception_is_fatal
  hang in the core                     test_injected_hang_dumps_stacks_and_is_fatal_after_the_hang_timeout
  each end, one event (5 cases)        test_each_end_of_the_core_gives_one_event_with_its_reason
test_worker_faults.py:
  kill -9 of a TP worker, busy         test_worker_killed_under_load_is_fatal_at_once
  kill -9 of a TP worker, idle         test_kill_9_of_an_idle_worker_is_fatal_within_2_s
  kill -9 of node 1's worker, idle     test_node1_worker_killed_is_fatal_on_node0_within_2s
  kill -9 of node 1's worker, busy     test_node1_worker_killed_under_load_is_fatal_on_both_nodes_within_2s
  exception in a TP worker             test_an_exception_injected_in_a_worker_is_fatal
  hang in a TP worker                  test_a_hang_injected_in_a_worker_is_fatal_within_the_hang_timeout
test_supervisor_faults.py:
  kill -9 of the supervisor
    test_kill_9_of_the_supervisor_takes_every_child_and_the_next_start_reclaims
test_disconnect_storm.py (one shared server):
  disconnect storm: 50 streams         test_fifty_streams_hang_up
  disconnect storm: 10 plain           test_plain_requests_hang_up
test_filesystem_faults.py:
  full runtime filesystem at start     test_a_full_runtime_filesystem_at_start_up_exits_3_naming_the_path
  ... filled while serving             test_a_runtime_filesystem_filled_while_serving_is_a_clean_fatal_stop
test_two_hosts.py:
  SIGTERM to node 0                    test_sigterm_to_node_0_drains_both_hosts
  link cut under load                  test_the_link_cut_under_load_fails_both_hosts_fast_naming_the_peer
tests/test_containment.py (kept there, not counted here):
  exception in one request's sampling  test_a_faulty_request_fails_alone_while_a_stream_completes

`helpers.py` holds what the cases share (a slowed tiny server, its core, the end lines, a full tmpfs);
`netns.py` makes the two hosts; `tests/two_nodes.py` runs two nodes over 127.0.0.1. Cases that mount a tmpfs,
drop capabilities or make network namespaces need root and skip without it.
"""
