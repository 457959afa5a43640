// The etcd server for gpu-agent's end-to-end cluster: etcd's own entry point, etcdmain.Main.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
