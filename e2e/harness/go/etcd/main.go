// etcd's own main package lives in a module the proxy does not serve for 3.7;
// etcdmain.Main is what that main calls.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
