"""`python -m pflbench` and the installed `pflbench` command.

The command line interface is imported when `main` runs, not when this module is: the
installed command's script imports this module, and multiprocessing's forkserver and spawn
children import the parent's main script again before they run anything. Synthesis starts a
fresh process per unit of work (data.synth), 94 of them for the embedded task's corpora, and
each would otherwise import the whole CLI, torch included (~2.5 s): `pflbench data synth` took
6:49 that way, 2:29 now, on the 2-core machine while a sweep held its cores.
"""


def main() -> None:
    from pflbench.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
