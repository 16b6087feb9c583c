"""A model of the warp-specialized kernel's dQ writers (kernels/attention_bwd_ws.py): does
any launch the launcher allows deadlock on the semaphores' turn order?

Program p's writer takes items p, p + P, ... and each item's steps in order; step s of
key block b of head h adds into query tile (s + b) % T with the rotated walk (turn s),
else into tile s (turn b), once that tile's count of adds equals its turn. The model
lets every program go as far as it can until none can; a launch deadlocks if some
program is left with work. (Run: python3 ws_turn_order_sim_script.py.)
"""


def completes(programs, heads, blocks, rotated):
    tiles = blocks                       # the rotated walk needs as many tiles as blocks
    items = heads * blocks
    queues = [[(i, s) for i in range(p, items, programs) for s in range(tiles)]
              for p in range(programs)]
    done = [0] * programs
    count = {}
    progress = True
    while progress:
        progress = False
        for p in range(programs):
            while done[p] < len(queues[p]):
                item, step = queues[p][done[p]]
                block, head = item % blocks, item // blocks
                tile = (step + block) % tiles if rotated else step
                turn = step if rotated else block
                if count.get((head, tile), 0) != turn:
                    break
                count[(head, tile)] = turn + 1
                done[p] += 1
                progress = True
    return all(done[p] == len(queues[p]) for p in range(programs))


allowed_deadlocks = [
    (blocks, programs, heads, rotated)
    for blocks in range(1, 8) for programs in range(1, 40)
    for heads in (1, 2, 3, 5, 7, 12, 31, 64) for rotated in (False, True)
    if (not rotated or programs >= blocks)
    and not completes(programs, heads, blocks, rotated)]
print("deadlocks where the launcher allows the launch:", allowed_deadlocks)
print("rotated, 5 blocks a head, 12 heads, on 2 / 3 / 4 programs (refused by the "
      "launcher) completes:", [completes(p, 12, 5, True) for p in (2, 3, 4)])
print("rotated, 5 blocks a head, 192 heads, on 132 / 8 / 5 programs completes:",
      [completes(p, 192, 5, True) for p in (132, 8, 5)])
