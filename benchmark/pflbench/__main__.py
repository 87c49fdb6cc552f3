from pflbench.cli import main

main()
