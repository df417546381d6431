from pdctl.cli import main

main()
